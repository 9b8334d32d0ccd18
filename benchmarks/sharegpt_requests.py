"""Chat requests for a model to answer: ShareGPT conversations' opening user turns (or, with
--follow-ups, their later user turns with the talk before them), as a prompt file.

    python benchmarks/sharegpt_requests.py SHAREGPT.json --count 4000 --out FILE.jsonl.gz \
        [--skip EARLIER.jsonl.gz ...] [--max-chars 2000] [--min-chars 10] [--seed 0] \
        [--follow-ups [--max-context-chars 2500] [--skip-conversations HELD.jsonl.gz ...]]

Chat is where the Qwen 1.5B's head is furthest from issue #9's goal, and its own answers to
ShareGPT first turns are what lifted it (docs/performance.md, twenty-eighth round: 1,265 of them,
held-out chat 1.75 -> 1.82). The sixteenth round's 4,000 (results/sg_chat16.jsonl.gz) were cut by
hand; this writes more the same way, reproducibly:

- a conversation's first user turn, and only of a conversation's first part (ShareGPT splits long
  conversations into parts ID_0, ID_1, ...; a later part's first turn is the middle of a talk);
- between --min-chars and --max-chars characters (a long paste is mostly the paste, and its answer
  runs past the generation's 256 tokens);
- each text once (whitespace folded: ShareGPT repeats popular openings), none already in a
  --skip file (by text or by id), so a new file adds requests instead of repeating them;
- shuffled with SEED, the first COUNT kept: records {"id", "domain": "chat", "text"}, the prompt
  format of results/sg_chat16.jsonl.gz, which GEN_PROMPTS and borrow_prompts.py read.

--follow-ups writes each later user turn of a conversation's first part instead, as a record
{"id": "ID/turnN", "domain": "chat", "messages": [...]} holding the talk up to and including that
turn (ChatGPT's answers as the assistant turns), when the turn is within the length bounds and the
talk before it within --max-context-chars (a row is the talk plus the model's answer, inside
distill's --max-len). The package's ShareGPT holds about 1,400 opening code requests and about
6,400 later turns of conversations about code (thirty-third round): a person's follow-up ("now
make it async", "it fails with ...") is a request in that person's words too.
--skip-conversations leaves out every follow-up of the conversations a file's requests open (a
held-out opening's talk, ChatGPT's answer included, stays out of the training prompts).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dspark_lab.lab.corpus import sharegpt_conversations  # noqa: E402
from synthetic_prompts import write_prompt_file  # noqa: E402
from unanswered_prompts import read_jsonl  # noqa: E402


# Words a request about code uses: a fence, a language or framework, or a programming word, each
# whole (\b: "rust" is not "trust", "script" not "description"). A heuristic: a TV programme or a
# maths "function" passes too, which costs a chat row counted as code, never a wrong token.
_CODE_WORDS = re.compile(
    r"```|\b(?:code|coding|function|method|class|scripts?|program(?:s|ming)?|api|sql|regex|json|html|css|bash|shell|"
    r"python|javascript|typescript|java|kotlin|swift|golang|rust|php|ruby|scala|perl|haskell|matlab|vba|c\+\+|c#|"
    r"react|vue|angular|node\.?js|django|flask|pandas|numpy|pytorch|tensorflow|docker|kubernetes|git|compile[sd]?|"
    r"debug|bug|algorithm|database|query|frontend|backend|endpoint|def|import)(?![\w+#])",
    re.IGNORECASE,
)


def asks_for_code(text: str) -> bool:
    """Whether a chat request is about code, by the words it uses (_CODE_WORDS)."""
    return _CODE_WORDS.search(text) is not None


def _fold(text: str) -> str:
    return " ".join(text.split())


def first_part(conversation_id: str) -> bool:
    """Whether an id names a conversation's first part (ID_0), or a conversation never split."""
    stem, sep, part = conversation_id.rpartition("_")
    return not (sep and stem and part.isdigit()) or part == "0"


def opening_turns(path: Path, *, min_chars: int, max_chars: int, skip: list[dict]) -> list[dict]:
    """Every usable opening request in the file, in file order, each text once."""
    seen_texts = {_fold(r.get("text", "")) for r in skip}
    seen_ids = {str(r.get("id")) for r in skip}
    out = []
    for cid, messages in sharegpt_conversations(path):
        text = messages[0]["content"].strip()
        key = _fold(text)
        if not first_part(cid) or cid in seen_ids or key in seen_texts or not min_chars <= len(text) <= max_chars:
            continue
        seen_texts.add(key)
        out.append({"id": cid, "domain": "chat", "text": text})
    return out


MAX_CONTEXT_CHARS = 2500  # --follow-ups: the talk before a turn, about 600 tokens of distill's --max-len 1024


def conversation_and_turn(request_id: str) -> tuple[str, str | None]:
    """The ShareGPT conversation a request comes from, and its follow-up turn if it is one:
    "abc_0" and "sg_chat29/abc_0" (a borrowed file prefixes its set's name) are (abc_0, None),
    "abc_0/turn2" and "sg_follow/abc_0/turn2" are (abc_0, turn2)."""
    parts = request_id.split("/")
    turn = parts.pop() if len(parts) > 1 and re.fullmatch(r"turn\d+", parts[-1]) else None
    return parts[-1], turn


def conversation_of(request_id: str) -> str:
    return conversation_and_turn(request_id)[0]


def follow_up_turns(path: Path, *, min_chars: int, max_chars: int, max_context_chars: int, skip: list[dict],
                    skip_conversations: set[str] = frozenset()) -> list[dict]:
    """Every usable later user turn in the file, in file order, with the talk before it; each talk
    once; none that a skip record names (its own id or a borrowed file's), none of a conversation
    in skip_conversations (ids as conversation_of gives them)."""
    seen_turns = {conversation_and_turn(str(r.get("id"))) for r in skip}
    seen_talks = set()
    out = []
    for cid, messages in sharegpt_conversations(path):
        if not first_part(cid) or cid in skip_conversations:
            continue
        folded = [_fold(m["content"]) for m in messages]  # once per conversation, not once per later turn
        lengths = [len(m["content"]) for m in messages]
        for i in range(2, len(messages), 2):  # sharegpt_conversations alternates: user turns are even
            text = messages[i]["content"].strip()
            talk = tuple(folded[: i + 1])
            if ((cid, f"turn{i // 2}") in seen_turns or talk in seen_talks or not min_chars <= len(text) <= max_chars
                    or sum(lengths[:i]) > max_context_chars):
                continue
            seen_talks.add(talk)
            out.append({"id": f"{cid}/turn{i // 2}", "domain": "chat", "messages": messages[:i] + [{"role": "user", "content": text}]})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sharegpt", type=Path, help="a ShareGPT JSON file ([{id, conversations: [{from, value}, ...]}, ...])")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip", type=Path, nargs="*", default=[], help="prompt files whose requests to leave out")
    ap.add_argument("--min-chars", type=int, default=10)
    ap.add_argument("--max-chars", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--follow-ups", action="store_true",
                    help="later user turns with the talk before them (as chat messages), not opening turns")
    ap.add_argument("--max-context-chars", type=int, default=None,
                    help=f"with --follow-ups: the most characters of talk before the turn (default {MAX_CONTEXT_CHARS})")
    ap.add_argument("--skip-conversations", type=Path, nargs="*", default=[],
                    help="with --follow-ups: prompt files (held-out ones) whose requests' conversations to leave out")
    args = ap.parse_args(argv)
    if not args.sharegpt.is_file():
        raise SystemExit(f"{args.sharegpt}: no such file (the ShareGPT JSON; prepare_device_session.sh unpacks it into /tmp/dspark-session/sg)")
    if args.count < 1:
        raise SystemExit(f"--count must be at least 1, got {args.count}")
    if args.max_context_chars is not None and args.max_context_chars < 1:
        raise SystemExit(f"--max-context-chars must be at least 1 (the characters of talk a follow-up turn may have before it), "
                         f"got {args.max_context_chars}")
    if not args.follow_ups and (args.skip_conversations or args.max_context_chars is not None):
        raise SystemExit("--skip-conversations and --max-context-chars choose follow-up turns: add --follow-ups")
    skip = [r for f in args.skip for r in read_jsonl(f)]
    if args.follow_ups:
        kind = "follow-up turns"
        held = {conversation_of(str(r.get("id"))) for f in args.skip_conversations for r in read_jsonl(f)}
        turns = follow_up_turns(args.sharegpt, min_chars=args.min_chars, max_chars=args.max_chars,
                                max_context_chars=MAX_CONTEXT_CHARS if args.max_context_chars is None else args.max_context_chars, skip=skip, skip_conversations=held)
    else:
        kind = "opening turns"
        turns = opening_turns(args.sharegpt, min_chars=args.min_chars, max_chars=args.max_chars, skip=skip)
    random.Random(args.seed).shuffle(turns)
    if len(turns) < args.count:
        print(f"only {len(turns)} usable {kind} (asked for {args.count}): writing them all")
    kept = turns[:args.count]
    write_prompt_file(args.out, kept)
    print(f"{len(kept)} of {len(turns)} usable {kind} ({len(skip)} requests skipped as given) -> {args.out}")


if __name__ == "__main__":
    main()
