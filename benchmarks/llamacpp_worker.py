"""llama.cpp's side of benchmarks/llamacpp_quantized.py, run in llama-cpp-python's own venv.

    LLAMA_VENV/bin/python benchmarks/llamacpp_worker.py MODEL.gguf THREADS

Reads one JSON request per line on stdin, {"ids": [...], "max_new_tokens": N, "lookup": null or
[num_pred_tokens, max_ngram_size]}, greedily decodes the given token ids (no chat template of its
own: the caller sends specjax's ids) and answers one JSON line, {"tokens": [...]}: the new tokens,
stopped after EOS or at N. It imports nothing of specjax, so it runs in a venv that has only
llama-cpp-python.
"""

import json
import sys

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    options = dict(model_path=path, n_ctx=4096, n_batch=512, n_threads=threads, verbose=False)
    plain = Llama(**options)
    lookups: dict[tuple[int, int], Llama] = {}  # prompt lookup needs every position's logits
    for line in sys.stdin:
        request = json.loads(line)
        if request["lookup"] is None:
            llm = plain
        else:
            k, n = request["lookup"]
            if (k, n) not in lookups:
                draft = LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=n)
                lookups[k, n] = Llama(**options, logits_all=True, draft_model=draft)
            llm = lookups[k, n]
        # reset() forgets the previous call's tokens, so the prompt is prefilled again every time
        # (generate would otherwise reuse the KV cache of a common prefix: a repeated prompt would
        # skip its prefill, which specjax does not).
        llm.reset()
        tokens = []
        for token in llm.generate(request["ids"], temp=0.0, top_k=1, reset=True):
            tokens.append(token)
            if token == llm.token_eos() or len(tokens) == request["max_new_tokens"]:
                break
        print(json.dumps({"tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
