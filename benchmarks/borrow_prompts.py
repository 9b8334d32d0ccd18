"""One prompt file of the requests other models' rounds wrote, less those this model answered already.

    python benchmarks/borrow_prompts.py PROMPTS.jsonl.gz ... --model DIR --answered ROWS.jsonl.gz ... \
        --out FILE.jsonl.gz [--seed 0] [--count N [--rest REST.jsonl.gz [--drop-twins 0.5]]] [--asks-for code|other]

The 1.5B's head learns from 7,025 of its own answers, the 0.5B's from 38,261 (docs/performance.md,
twenty-sixth round): most requests in the data were written by, and answered by, the 0.5B. Its
prompt files (docs/results/self_instruct*_qwen05_*.jsonl.gz) are requests any model of the family
can answer, so the 1.5B can answer them itself (GEN_PROMPTS in h200_corpus_heads.sh) without
spending minutes writing new ones.

- Each record keeps its fields (a prompt file's: messages or text, domain, reference); its id
  gets its file's name in front (`self_instruct13_qwen05_code/selfcode-00001`), since every
  round numbered its requests from 1.
- A request is dropped when a row in ANSWERED written by MODEL (its `model` field names MODEL's
  folder) starts with the same prompt tokens: the chat-templated ids distill would feed, so a
  request the model answered under another file's name is caught too.
- The records are shuffled (SEED): a generation stopped by its clock answers the first records
  only, and shuffled that is an even share of every file rather than the first files whole.
- `--count N` keeps the first N of the shuffled records: a fixed sample, e.g. held-out requests
  whose answers no head trains on (list their answers under --answered from then on, so that no
  later borrowed file asks them again). `--rest FILE` writes the others to FILE: a new prompt
  file split in one step into a held-out sample and the requests to train on; `--drop-twins 0.5`
  leaves out of FILE the requests whose words are half or more a held-out request's.
- `--asks-for code` keeps the requests about code only (a code set's, and the chat requests with a
  user turn whose words are a programmer's: `sharegpt_requests.asks_for_code`), `--asks-for other` the rest. People's
  code requests are where the 1.5B's head drafts worst (docs/performance.md, thirty-second round).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dspark_lab.engine.loading import load_tokenizer  # noqa: E402
from dspark_lab.engine.text import encode_prompt  # noqa: E402
from dspark_lab.lab.prompts import load_prompt_set  # noqa: E402
from dspark_lab.lab.prompts.core import Prompt  # noqa: E402
from prompt_twins import jaccard, prompt_text, words  # noqa: E402
from sharegpt_requests import asks_for_code  # noqa: E402
from synthetic_prompts import write_prompt_file  # noqa: E402
from unanswered_prompts import read_jsonl  # noqa: E402


def answered_prompts(rows: list[dict], model_name: str) -> set[tuple[int, ...]]:
    """The prompt token ids of every row the named model wrote."""
    return {tuple(r["ids"][: r["prompt_len"]]) for r in rows if r.get("model") == model_name and "prompt_len" in r}


def is_code_request(p: Prompt) -> bool:
    """A code request: a code set's, or a chat request with a user turn about code (a follow-up,
    "now make it faster", is about code when the talk it follows is)."""
    if p.domain == "code":
        return True
    turns = p.messages if p.messages is not None else [{"role": "user", "content": p.text or ""}]
    return any(asks_for_code(m["content"]) for m in turns if m.get("role") == "user")


def borrow(files: list[Path], tokenizer, answered: set[tuple[int, ...]], seed: int, say=print, asks_for: str = "") -> list[dict]:
    kept: list[dict] = []
    for path in files:
        prompt_set = load_prompt_set(str(path))  # validated; chat messages or plain text alike
        # The ids distill feeds the model for this prompt (distill.py encodes p.as_input() the same way).
        fresh = [p for p in prompt_set.prompts if tuple(encode_prompt(tokenizer, p.as_input())) not in answered]
        kind = ""
        if asks_for:
            fresh = [p for p in fresh if is_code_request(p) == (asks_for == "code")]
            kind = f" and {'about' if asks_for == 'code' else 'not about'} code"
        kept += [{**p.to_dict(), "id": f"{prompt_set.name}/{p.id}"} for p in fresh]
        say(f"{prompt_set.name}: {len(fresh)} of {len(prompt_set.prompts)} requests not yet answered by this model{kind}")
    random.Random(seed).shuffle(kept)
    return kept


def drop_twins(rest: list[dict], held: list[dict], likeness: float) -> list[dict]:
    """The records of `rest` less alike than `likeness` to every record of `held` (prompt_twins.py's
    likeness: the Jaccard index of the two texts' word sets). The records are Prompt.to_dict()'s."""
    def words_of(r: dict) -> frozenset[str]:
        return words(prompt_text(Prompt(**r)))

    held_words = [words_of(r) for r in held]
    return [r for r, w in ((r, words_of(r)) for r in rest) if all(jaccard(w, h) < likeness for h in held_words)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt_files", nargs="+", type=Path)
    ap.add_argument("--model", type=Path, required=True, help="the model that will answer (its folder: tokenizer and name)")
    ap.add_argument("--answered", type=Path, nargs="*", default=[], help="rows files (distill data or generated rows)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=0, help="keep the first N shuffled requests (0: all)")
    ap.add_argument("--rest", type=Path, help="with --count: write the requests after the first N here (a held-out "
                                               "sample in --out and the rest to train on, disjoint)")
    ap.add_argument("--drop-twins", type=float, default=0.0, metavar="LIKENESS",
                    help="with --rest: leave out of it the requests whose words are this alike to a held-out one's or "
                         "more (prompt_twins.py's likeness, e.g. 0.5: ShareGPT repeats openings with small changes; 0: none)")
    ap.add_argument("--asks-for", choices=["code", "other"], default="",
                    help="keep only the requests about code (a code set's, or a chat request using code words: "
                         "sharegpt_requests.asks_for_code), or only the others")
    a = ap.parse_args(argv)
    if a.count < 0:
        ap.error(f"--count must be >= 0 (0: every request), got {a.count}")
    if a.drop_twins and not a.rest:
        ap.error("--drop-twins leaves requests out of --rest: give --count and --rest too")
    if a.rest and not a.count:
        ap.error("--rest takes the requests after the first --count N: give --count too")
    if not (a.model / "config.json").is_file():
        ap.error(f"--model {a.model} is not a model folder (no config.json); pass the folder distill loads, e.g. "
                 "~/.cache/dspark-lab/models/qwen2.5-coder-1.5b-q4-bfloat16")
    rows = [row for path in a.answered for row in read_jsonl(path)]
    answered = answered_prompts(rows, a.model.name)
    print(f"{len(answered)} prompts answered by {a.model.name} in {len(rows)} rows")
    kept = borrow(a.prompt_files, load_tokenizer(a.model), answered, a.seed, asks_for=a.asks_for)
    rest = kept[a.count :] if a.count else []
    if a.count:
        kept = kept[: a.count]
    write_prompt_file(a.out, kept)
    print(f"{len(kept)} requests -> {a.out}")
    if a.rest:
        if a.drop_twins:
            twins = len(rest)
            rest = drop_twins(rest, kept, a.drop_twins)
            print(f"{twins - len(rest)} requests left out of {a.rest}: their words are {a.drop_twins} or more alike to a held-out one's")
        write_prompt_file(a.rest, rest)
        print(f"{len(rest)} requests -> {a.rest}")


if __name__ == "__main__":
    main()
