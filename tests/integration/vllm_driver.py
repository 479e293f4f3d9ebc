"""Runs real vLLM (CPU) for tests/integration/test_vllm.py, in the vLLM environment (.venv-vllm).

``make-model DIR``: a tiny random-weight Llama with a word-level tokenizer, saved to DIR.
``serve DIR STEPS``: one vLLM engine with kvstored's connector runs the steps of the JSON file STEPS
in order and prints one JSON line per prompt: the greedy tokens and vLLM's ``num_cached_tokens``.
A step is ``{"prompt": [token ids], "max_tokens": n}``, ``{"reset": true}`` (empty vLLM's own
prefix cache, so the next prompt can only come from kvstored) or ``{"wait_for": path}`` (the test
does something to the daemon, then creates the file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# vLLM's engine in this process (~15 s a process instead of ~55 s), bound to loopback; no compile
# (asking for anything beyond tokens would otherwise compile for ~30 s)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

VOCAB = 1024
BLOCK_SIZE = 64        # a multiple of 32 on CPU
MARK = "KVSTORED-TEST"
CHUNK_TOKENS = 512      # vLLM's max_num_batched_tokens: longer prompts are prefilled in chunks


def report(line: dict[str, object]) -> None:
    """One line for the test, marked: vLLM logs to stdout too."""
    print(MARK, json.dumps(line), flush=True)


def make_model(directory: str) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    # initializer_range 0.3: with the default 0.02 greedy decoding repeats one token, and the
    # tests could not tell the right KV from a wrong one
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(directory)


def serve(directory: str, steps_path: str, extra: dict[str, object], module: str, name: str,
          hash_algo: str = "sha256_cbor", role: str = "kv_both") -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = KVTransferConfig(kv_connector=name, kv_connector_module_path=module, kv_role=role,
                                kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    llm = LLM(model=directory, dtype="float32", enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo,
              enforce_eager=True, max_model_len=2048, max_num_batched_tokens=CHUNK_TOKENS,
              enable_chunked_prefill=True, block_size=BLOCK_SIZE, skip_tokenizer_init=True, seed=0,
              kv_cache_memory_bytes=256 << 20, kv_transfer_config=transfer)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    # the engine runs in this process: the worker's connector is here
    report({"path": get_kv_transfer_group().path})
    for step in json.loads(Path(steps_path).read_text()):
        if "wait_for" in step:
            while not Path(step["wait_for"]).exists():
                time.sleep(0.05)
        elif step.get("reset"):
            llm.reset_prefix_cache()
        else:
            params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True,
                                    detokenize=False)
            out = llm.generate([TokensPrompt(prompt_token_ids=step["prompt"])], params, use_tqdm=False)[0]
            report({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-model")
    make.add_argument("dir")
    run = sub.add_parser("serve")
    run.add_argument("dir")
    run.add_argument("steps")
    run.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    run.add_argument("--module", default="kvstored_client.vllm.connector")
    run.add_argument("--connector", default="KVStoredConnector")
    run.add_argument("--hash-algo", default="sha256_cbor", help="vLLM's prefix_caching_hash_algo")
    run.add_argument("--role", default="kv_both", help="vLLM's kv_role")
    args = parser.parse_args()
    if args.command == "make-model":
        make_model(args.dir)
    else:
        serve(args.dir, args.steps, json.loads(args.extra), args.module, args.connector, args.hash_algo, args.role)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
