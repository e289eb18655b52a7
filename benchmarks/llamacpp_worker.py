"""llama.cpp's side of benchmarks/llamacpp_quantized.py, run in llama-cpp-python's own venv.

    LLAMA_VENV/bin/python benchmarks/llamacpp_worker.py MODEL.gguf THREADS [DRAFT.gguf]

Reads one JSON request per line on stdin, {"ids": [...], "max_new_tokens": N, "lookup": null or
[num_pred_tokens, max_ngram_size], "draft": null or k}, greedily decodes the given token ids (no
chat template of its own: the caller sends specjax's ids) and answers one JSON line, {"tokens":
[...]}: the new tokens, stopped after EOS or at N. "draft": k has the model DRAFT.gguf (a
quantized copy of MODEL, say) propose k tokens a step. It imports nothing of specjax, so it runs in
a venv that has only llama-cpp-python.
"""

import json
import sys

import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding


class ModelDraft(LlamaDraftModel):
    """A second model proposing k greedy tokens, its KV cache kept from call to call.

    llama-cpp-python ships prompt lookup as its only draft; this is llama.cpp's draft-model
    speculation (the llama-speculative example) through the same hook: each call is handed the
    sequence so far, keeps the part of the draft's cache that still matches it, feeds the rest in
    one batch, then feeds its own greedy tokens one at a time."""

    def __init__(self, llm: Llama, k: int):
        self.llm, self.k = llm, k

    def __call__(self, input_ids, /, **kwargs):
        llm = self.llm
        held = llm.input_ids[: llm.n_tokens]
        keep = min(llm.n_tokens, len(input_ids) - 1)  # at least the last token is fed: its logits
        differ = np.nonzero(held[:keep] != input_ids[:keep])[0]
        llm.n_tokens = int(differ[0]) if len(differ) else keep  # eval drops the cache from here
        llm.eval(input_ids[llm.n_tokens :].tolist())
        drafts = []
        for i in range(self.k):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
            drafts.append(int(np.argmax(logits)))
            if i < self.k - 1:
                llm.eval(drafts[-1:])
        return np.array(drafts, dtype=np.intc)


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    draft_path = sys.argv[3] if len(sys.argv) > 3 else None
    options = dict(n_ctx=4096, n_batch=512, n_threads=threads, verbose=False)
    plain = Llama(model_path=path, **options)
    drafting: dict[tuple, Llama] = {}  # speculation needs every position's logits
    draft_llm = None
    for line in sys.stdin:
        request = json.loads(line)
        lookup, k = request["lookup"], request.get("draft")
        if lookup is None and k is None:
            llm = plain
        else:
            key = ("lookup", *lookup) if lookup is not None else ("draft", k)
            if key not in drafting:
                if lookup is not None:
                    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup[0], max_ngram_size=lookup[1])
                else:
                    if draft_path is None:
                        raise SystemExit("a draft request needs the worker's DRAFT.gguf argument")
                    draft_llm = draft_llm or Llama(model_path=draft_path, **options)
                    draft = ModelDraft(draft_llm, k)
                drafting[key] = Llama(model_path=path, **options, logits_all=True, draft_model=draft)
            llm = drafting[key]
            if k is not None:
                draft_llm.reset()  # the draft prefills the prompt again too
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
