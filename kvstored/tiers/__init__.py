"""Storage tiers: mechanism only (allocate, map, free); decisions live in kvstored.policy."""
