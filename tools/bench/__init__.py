"""kvstored's benchmarks, one package: ``python -m tools.bench`` measures kvstored side by side with
same-run limits and peer stores; ``python -m tools.bench SUBCOMMAND`` runs one focused benchmark."""
