"""vLLM's CPU build as a benchmark peer, seen from specjax's side: one `vllm_worker.py` process in
vLLM's own venv (`VLLM`), fed the token ids specjax feeds its own model, and the built-in model
written as the HF folder it reads (`hf_folder`). The worker's docstring says how to set its venv up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specjax.planner import eos_ids

DEFAULT_FOLDER = "/tmp/smollm2-135m-hf"


class VLLM:
    """One vllm_worker.py process (its venv's python), answering a request per call."""

    def __init__(
        self,
        python: str,
        folder: Path,
        ngram: int = 0,
        max_model_len: int = 2048,
        prefix_caching: bool = False,
        max_num_seqs: int | None = None,
    ):
        worker = Path(__file__).resolve().parent / "vllm_worker.py"
        command = [
            python,
            str(worker),
            str(folder),
            "--ngram",
            str(ngram),
            "--max-model-len",
            str(max_model_len),
            *(["--prefix-caching"] if prefix_caching else []),
            *([] if max_num_seqs is None else ["--max-num-seqs", str(max_num_seqs)]),
        ]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()  # "ready", once its engine is up

    def _answer(self) -> str:
        for line in self.process.stdout:  # vLLM's own log lines pass by
            if line.startswith("@@ "):
                return line[3:]
        raise RuntimeError(f"vllm_worker.py ended (exit code {self.process.wait()})")

    def _ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self._answer())

    def generate(self, ids, max_new_tokens: int, schema=None) -> tuple[list[int], float]:
        """One prompt's greedy tokens (under a JSON schema where given) and the call's seconds."""
        answer = self._ask(
            {"ids": list(map(int, ids)), "max_new_tokens": max_new_tokens, "json_schema": schema}
        )
        return answer["tokens"], answer["seconds"]

    def generate_batch(self, batch, max_new_tokens: int, reset_prefix_cache: bool = False):
        """The prompts' greedy tokens from one `LLM.generate` call, and its seconds (its prefix
        cache emptied first where asked)."""
        request = {"batch": [list(map(int, ids)) for ids in batch], "max_new_tokens": max_new_tokens}
        answer = self._ask({**request, "reset_prefix_cache": reset_prefix_cache})
        return answer["tokens"], answer["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def hf_folder(model, folder: Path) -> Path:
    """The built-in model's weights and tokenizer as an HF folder vLLM reads (written once)."""
    if not (folder / "config.json").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from hf_export import save_hf_folder  # tests' torch-free writer of HF checkpoints

        save_hf_folder(model, folder)
        model.tokenizer.save_pretrained(str(folder))
        config = json.loads((folder / "config.json").read_text())
        config.update(
            eos_token_id=list(eos_ids(model)), torch_dtype="float32", architectures=["LlamaForCausalLM"]
        )
        (folder / "config.json").write_text(json.dumps(config))
    return folder
