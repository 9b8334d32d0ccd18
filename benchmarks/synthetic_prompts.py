"""Write a prompt JSONL of generated requests, school-math word problems or code tasks, for distill data.

The built-in sets are held out for evaluation, and PyPI carries no math corpus and only HumanEval's
164 code problems, so a head's rows of these kinds would otherwise come mostly from chat logs.

- `--kind math`: problem *families* (rates, percentages, equations, areas, probability, ...) with
  random names and numbers, GSM8K-style; half ask for the step-by-step format with a final
  "Answer:" line.
- `--kind code`: programming tasks (strings, lists, graphs, parsing, ...) asked for in one of nine
  languages, as a function to write, a thing to implement or a how-to question, with an optional
  extra (example calls, unit tests, complexity, edge cases); and, in about one in six, a SQL
  query or a shell script.

The target's own answers to these are what the head learns from (`distill --prompts FILE`, or
`GEN_PROMPTS` in benchmarks/h200_corpus_heads.sh). A generated text equal to a built-in prompt is
dropped and no code task restates one, so the held-out prompts never reach training; the kinds do
overlap with them, as a train split overlaps its test split.

    python benchmarks/synthetic_prompts.py --kind math --n 2500 --out math_synth.jsonl
    python benchmarks/synthetic_prompts.py --kind code --n 3000 --out code_synth.jsonl
    python benchmarks/synthetic_prompts.py --kind code --n 3000 --seed 1 --exclude code_synth.jsonl --out code_synth2.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

# Draws in a row that may find nothing new before a generator says its space is used up: with
# --exclude files taking most of the distinct prompts, asking for more would otherwise loop forever.
MAX_MISSES = 200_000


def _used_up(kind: str, made: int, n: int) -> ValueError:
    return ValueError(
        f"only {made} of the {n} {kind} prompts asked for could be made: the generator's distinct {kind} "
        f"prompts ({MAX_MISSES:,} draws in a row found nothing new) are taken by the built-in set and the "
        f"--exclude files. Ask for fewer (--n {made}) or leave out an --exclude file."
    )

NAMES = ["Ava", "Ben", "Chen", "Dara", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemi", "Luis",
         "Maya", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Victor", "Wen", "Yara"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cupcakes", "tickets", "stamps", "cards", "shells"]
STEP_SYSTEM = "Solve the problem step by step. End with a line of the form 'Answer: <final answer>'."


def _math_families(r: random.Random):
    n, m = r.choice(NAMES), r.choice(NAMES)
    it = r.choice(ITEMS)
    a, b, c = r.randint(2, 40), r.randint(2, 40), r.randint(2, 12)
    yield f"{n} has {a * c} {it} and gives {c} of them to each of {r.randint(2, a)} friends. How many {it} does {n} have left?"
    cents = r.randint(2, 9) * 100 + r.choice([25, 50, 75, 99])
    bill = next(v for v in (20, 50, 100, 200) if v * 100 >= c * cents)
    yield f"{n} buys {c} notebooks at ${cents // 100}.{cents % 100:02d} each and pays with a ${bill} bill. How much change does {n} get?"
    yield f"A shirt costs ${r.randint(15, 120)}. It is discounted by {r.choice([10, 15, 20, 30, 40])}% and then a {r.choice([5, 6, 7, 8, 9])}% tax is added. What is the final price?"
    yield f"Solve for x: {a}x + {b} = {c}x + {a + b + r.randint(1, 30)}"
    yield f"Solve the system of equations: {r.randint(1, 6)}x + {r.randint(1, 6)}y = {r.randint(10, 60)} and x - y = {r.randint(-5, 9)}."
    yield f"A car drives {a * 10} km at {r.choice([40, 50, 60, 80, 90])} km/h and then {b * 10} km at {r.choice([30, 70, 100, 110])} km/h. How long does the whole drive take, and what is the average speed?"
    yield f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter? If each side is increased by {c} cm, by how much does the area grow?"
    yield f"A circle has a radius of {c} m. Find its circumference and its area, to two decimal places."
    yield f"{n} is {a} years old and {m} is {c} times as old as {n} was {r.randint(1, a - 1) if a > 1 else 1} years ago. How old is {m}?"
    yield f"A tank holds {a * 50} liters. One pipe fills it in {c} hours and another drains it in {c + r.randint(1, 10)} hours. With both open, how long does it take to fill the empty tank?"
    yield f"What is {r.randint(2, 9)}/{r.randint(10, 15)} + {r.randint(1, 9)}/{r.randint(2, 9)}, as a fraction in lowest terms?"
    yield f"A bag holds {a} red and {b} blue marbles. Two are drawn without replacement. What is the probability that both are red?"
    yield f"If you flip a fair coin {c} times, what is the probability of getting exactly {r.randint(0, c)} heads?"
    yield f"In how many ways can {r.randint(2, 5)} prizes be given to {r.randint(6, 15)} people if no one gets more than one prize and the prizes are all different?"
    yield f"Find the derivative of f(x) = {r.randint(2, 9)}x^{r.randint(2, 6)} {r.choice(['+', '-'])} {r.randint(1, 9)}{r.choice(['cos(x)', 'e^x', 'ln(x)', 'x'])}."
    yield f"Evaluate the definite integral of ({r.randint(1, 9)}x^{r.randint(1, 3)} + {r.randint(1, 9)}) from x = 0 to x = {r.randint(1, 4)}."
    yield f"The sum of {c} consecutive integers is {c * a + c * (c - 1) // 2}. What are the integers?"
    yield f"What is the {r.randint(10, 60)}th term of the arithmetic sequence {a}, {a + c}, {a + 2 * c}, ...? What is the sum of its first {r.randint(10, 40)} terms?"
    yield f"{n} invests ${a * 100} at {r.choice([2, 3, 4, 5, 6])}% interest compounded yearly. How much is it worth after {c} years?"
    yield f"A recipe needs {r.randint(2, 5)} cups of flour for {r.randint(10, 24)} cookies. How much flour is needed for {r.randint(30, 100)} cookies?"
    yield f"{n} reads {a} pages a day and {m} reads {b} pages a day. A book has {(a + b) * c * 3} pages. If they start together, how many pages has each read when together they have finished the book {c} times?"
    yield f"What is the greatest common divisor and the least common multiple of {a * c} and {b * c}?"
    yield f"Convert {a * 37} minutes to hours and minutes, and {b * 1000 + r.randint(0, 999)} meters to kilometers."
    yield f"A triangle has sides {3 * c}, {4 * c} and {5 * c}. Is it a right triangle? Find its area."
    yield f"Workers paint a fence: {c} workers take {a} hours. How long would {c + r.randint(1, 6)} workers take at the same rate?"
    yield f"The average of {c} numbers is {a}. When one more number is added, the average becomes {a + 1}. What number was added?"


# Families (indices into _math_families) whose wording mirrors a held-out built-in math prompt:
# discount then tax (math-004), "Solve for x: ax + b = cx + d" (math-002), the system of equations
# (math-009), two legs of a drive (math-001), a rectangle's area and perimeter (math-014), two pipes
# and a tank (math-021), "Find the derivative of" (math-005), "Evaluate the definite integral of"
# (math-006), compound interest (math-010), "the greatest common divisor and the least common
# multiple of" (math-011). The ninth round's file was made with them; the tenth round's math
# acceptance is 3.48 on the five evaluated prompts they mirror and 2.29 on the other three
# (docs/performance.md), so a clean math evaluation needs them left out: --no-mirrors.
MIRROR_FAMILIES = frozenset({2, 3, 4, 5, 6, 9, 14, 15, 18, 21})
# The built-in math prompts a family copies (six of them among the eight a round evaluates):
# their acceptance says how well the head learnt a template, the others' (math-003, math-008) how
# well it generalizes. The ten named above, and math-007 ("If you roll a fair six-sided die 4 times,
# what is the probability of getting at least one six?"): the coin-flip family (12) asks the same
# repeated-trials question in the same sentence, at a likeness of 0.50-0.52 (prompt_twins.py's;
# its twin flag is 0.5), nearer than math-001 (0.32) and math-010 (0.21) are to their families.
# --no-mirrors still makes family 12: every round's data since the ninth holds it already, so
# leaving it out now would not make math-007 clean again, only change what a seed makes.
MIRRORED_PROMPTS = frozenset({"math-001", "math-002", "math-004", "math-005", "math-006", "math-007", "math-009", "math-010",
                              "math-011", "math-014", "math-021"})


def math_without_twin(row: dict) -> bool:
    """An evaluation row (lossless_check.py's: "set", "prompt") of a math prompt no template copies."""
    return row["set"] == "math" and row["prompt"] not in MIRRORED_PROMPTS


def synthetic_math_prompts(n: int, seed: int = 0, exclude: set[str] = frozenset(), mirrors: bool = True) -> list[dict]:
    """n prompt records ({"id", "domain", "text"} or {"messages"}), none whose text is in exclude;
    with mirrors=False none from a family in MIRROR_FAMILIES (the same random draws otherwise, so
    mirrors=True reproduces the files made before the option existed)."""
    r = random.Random(seed)
    out, seen, misses = [], set(exclude), 0
    while len(out) < n:
        family = list(_math_families(r))
        index = r.randrange(len(family))
        text = family[index]
        if not mirrors and index in MIRROR_FAMILIES:
            continue
        if text in seen:
            misses += 1
            if misses > MAX_MISSES:
                raise _used_up("math", len(out), n)
            continue
        seen.add(text)
        misses = 0
        pid = f"mathsynth-{len(out) + 1:05d}"
        if r.random() < 0.5:
            out.append({"id": pid, "domain": "math", "text": text})
        else:
            out.append({"id": pid, "domain": "math", "messages": [{"role": "system", "content": STEP_SYSTEM},
                                                                  {"role": "user", "content": text}]})
    return out


# (name, what it does): none restates a built-in code prompt (merge_intervals, an LRU cache, debounce,
# key=value parsing, a worker pool, ... are left out on purpose).
CODE_TASKS = [
    ("fibonacci", "returns the n-th Fibonacci number without recursion"),
    ("is_palindrome", "checks whether a string is a palindrome, ignoring case, spaces and punctuation"),
    ("count_vowels", "counts the vowels in a string"),
    ("flatten_list", "flattens a list of lists one level deep"),
    ("top_k_frequent", "returns the k most frequent elements of a list, most frequent first"),
    ("rotate_matrix", "rotates a square matrix 90 degrees clockwise in place"),
    ("merge_sorted", "merges two sorted arrays into one sorted array"),
    ("dedupe_keep_order", "removes duplicates from a list while keeping the first occurrence of each"),
    ("edit_distance", "computes the Levenshtein edit distance between two strings"),
    ("parse_csv_line", "splits one CSV line into fields, honouring double-quoted fields that contain commas"),
    ("roman_to_int", "converts a Roman numeral such as MCMXCIV to an integer"),
    ("int_to_roman", "converts an integer from 1 to 3999 to a Roman numeral"),
    ("binary_search", "finds the index of a value in a sorted array, or -1 if it is absent"),
    ("group_anagrams", "groups a list of words into lists of anagrams"),
    ("moving_average", "returns the moving averages of a list of numbers over a window of size k"),
    ("balanced_brackets", "checks whether the brackets (), [] and {} in a string are balanced"),
    ("longest_common_prefix", "finds the longest common prefix of a list of strings"),
    ("transpose", "transposes a matrix given as a list of rows"),
    ("primes_up_to", "returns all primes up to n with the sieve of Eratosthenes"),
    ("chunk", "splits a list into chunks of size n, the last one possibly shorter"),
    ("gcd", "computes the greatest common divisor of two integers with Euclid's algorithm"),
    ("human_size", "formats a number of bytes as a human-readable size such as 1.5 MB"),
    ("first_unique_char", "returns the index of the first character that appears only once in a string"),
    ("power_set", "returns every subset of a list"),
    ("permutations", "returns every permutation of a list without using a library function"),
    ("run_length_encode", "run-length encodes a string, turning aaabcc into a3b1c2"),
    ("reverse_words", "reverses the order of the words in a sentence"),
    ("max_subarray_sum", "returns the largest sum of a contiguous subarray (Kadane's algorithm)"),
    ("are_anagrams", "checks whether two strings are anagrams of each other"),
    ("min_stack", "implements a stack that also returns its minimum element in O(1)"),
    ("queue_with_stacks", "implements a FIFO queue using two stacks"),
    ("word_count", "counts the lines, words and characters of a text file"),
    ("median", "returns the median of a list of numbers"),
    ("intersection", "returns the elements two lists have in common, without duplicates"),
    ("snake_to_camel", "converts a snake_case identifier to camelCase"),
    ("valid_sudoku", "checks whether a filled 9x9 sudoku grid is valid"),
    ("pascal_triangle", "returns the first n rows of Pascal's triangle"),
    ("missing_number", "finds the one missing number in a list holding 0..n with one number left out"),
    ("sort_records", "sorts a list of people records by age, then by name"),
    ("retry_with_backoff", "calls a function and retries it with exponential backoff when it fails, up to a maximum number of attempts"),
    ("memoize", "wraps a function so that results for arguments seen before are returned from a cache"),
    ("count_islands", "counts the islands of 1s in a grid of 0s and 1s"),
    ("grid_shortest_path", "finds the length of the shortest path between two cells of a grid with walls, using BFS"),
    ("topological_sort", "orders tasks so that each comes after its dependencies, and reports a cycle"),
    ("dijkstra", "computes shortest distances from a start node in a weighted graph with Dijkstra's algorithm"),
    ("trie", "implements a trie with insert, search and starts_with"),
    ("is_power_of_two", "checks whether a number is a power of two using bit operations"),
    ("find_duplicates", "returns the values that appear more than once in an array"),
    ("ring_buffer", "implements a fixed-size circular buffer with push and pop"),
    ("valid_ipv4", "checks whether a string is a valid IPv4 address"),
    ("hamming_distance", "computes the Hamming distance between two strings of equal length"),
    ("matrix_multiply", "multiplies two matrices and rejects incompatible shapes"),
    ("two_sum_indices", "returns the indices of the two numbers in an array that add up to a target, in one pass"),
    ("caesar_cipher", "encrypts and decrypts text with a Caesar cipher"),
    ("bubble_sort", "sorts an array with bubble sort, stopping early when a pass makes no swap"),
    ("quicksort", "sorts an array with quicksort"),
    ("linked_list_cycle", "detects whether a singly linked list has a cycle"),
    ("tree_depth", "returns the maximum depth of a binary tree"),
    ("level_order", "returns the values of a binary tree level by level"),
    ("days_between", "returns the number of days between two dates given as YYYY-MM-DD strings"),
    ("title_case", "capitalizes the first letter of every word in a sentence"),
    ("digit_sum", "returns the sum of the digits of a non-negative integer"),
    ("histogram", "prints a text histogram of how often each value occurs in a list"),
    ("spiral_order", "returns the elements of a matrix in spiral order"),
]
# Queries and shell scripts, asked for as such (their own phrasings below).
EMP, ORD = "employees(id, name, department, salary, hired_at)", "orders(id, customer_id, amount, created_at)"
SQL_TASKS = [  # (table, what the query returns)
    (EMP, "lists each department with its number of employees and its average salary, largest department first"),
    (EMP, "returns the second highest salary in each department"),
    (EMP, "finds the employees hired in the same month as their department's longest-serving colleague"),
    (ORD, "finds the customers who placed no order in the last 30 days"),
    (ORD, "computes a running total of the order amounts per day"),
    (ORD, "counts the orders per weekday and per hour of the day"),
    (ORD, "shows the customers whose total spending is above the average customer's"),
    ("users(id, email, created_at)", "finds duplicate email addresses and how often each occurs"),
    ("users(id, email, created_at)", "deletes all but the newest row for each email"),
    ("logins(user_id, logged_in_at)", "finds the users who logged in on three consecutive days"),
    ("sales(day, region, revenue)", "pivots yearly revenue per region into one column per year"),
    ("scores(student_id, class_id, score)", "ranks the students in each class by their score, ties sharing a rank"),
]
SHELL_TASKS = [
    "renames every .jpeg file in a directory to .jpg",
    "prints the ten most frequent IP addresses in an nginx access log",
    "backs up a directory to a dated tar.gz archive and keeps only the last seven archives",
    "checks whether a list of hosts answers ping and prints the ones that do not",
    "counts the lines of code per file extension in a git repository",
    "watches a log file and prints every line that contains ERROR with a timestamp",
    "replaces a string in every .txt file under a directory, keeping a backup of each",
    "prints the disk usage of each subdirectory, sorted, in human-readable form",
    "downloads a list of URLs from a file, three at a time, retrying failures once",
    "converts every CSV file in a folder to TSV",
    "kills every process of the current user that has used more than an hour of CPU",
    "splits a large file into 100 MB pieces and prints their checksums",
]
CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "C", "C++", "Java"]
CODE_EXTRAS = ["", " Include a few example calls.", " Add unit tests.", " Explain the time and space complexity.",
               " Handle edge cases such as empty input.", " Add comments that explain each step."]


def _code_name(name: str, lang: str) -> str:
    if lang in ("Python", "Rust", "C", "C++"):
        return name
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def synthetic_code_prompts(n: int, seed: int = 0, exclude: set[str] = frozenset()) -> list[dict]:
    """n code-request prompt records ({"id", "domain", "messages"}), none whose text is in exclude."""
    r = random.Random(seed)
    out, seen, misses = [], set(exclude), 0
    if n > len(CODE_TASKS) * len(set(CODE_LANGS)) * len(CODE_EXTRAS) * 3:
        raise ValueError(f"--n {n} is more than the distinct code prompts this generator can make.")
    while len(out) < n:
        kind = r.random()
        query_extra = r.choice(["", " Explain each part.", " Add comments that explain each step."])  # no unit tests for these
        if kind < 0.08:
            table, task = r.choice(SQL_TASKS)
            text = r.choice([f"Given a table `{table}`, write a SQL query that {task}.{query_extra}",
                             f"Write a PostgreSQL query over `{table}` that {task}.{query_extra}"])
        elif kind < 0.16:
            text = r.choice([f"Write a bash script that {r.choice(SHELL_TASKS)}.{query_extra}",
                             f"How do I write a shell script that {r.choice(SHELL_TASKS)}?{query_extra}"])
        else:
            name, task = r.choice(CODE_TASKS)
            lang, extra = r.choice(CODE_LANGS), r.choice(CODE_EXTRAS)
            text = r.choice([
                f"Write a {lang} function `{_code_name(name, lang)}` that {task}.{extra}",
                f"In {lang}, write code that {task}.{extra}",
                f"How would you write a {lang} program that {task}?{extra}",
            ])
        if text in seen:
            misses += 1
            if misses > MAX_MISSES:
                raise _used_up("code", len(out), n)
            continue
        seen.add(text)
        misses = 0
        out.append({"id": f"codesynth-{len(out) + 1:05d}", "domain": "code", "messages": [{"role": "user", "content": text}]})
    return out


def builtin_texts(name: str) -> set[str]:
    """Every prompt and message text of a built-in set."""
    from dspark_lab.lab.prompts import load_prompt_set

    return _texts(load_prompt_set(name).prompts)


def file_texts(path: Path) -> set[str]:
    """Every prompt and message text of a prompt file (an earlier run's output, say)."""
    from dspark_lab.lab.prompts import load_prompt_sets

    return _texts([p for s in load_prompt_sets(str(path)) for p in s.prompts])


def _texts(prompts) -> set[str]:
    texts = set()
    for p in prompts:
        if p.text:
            texts.add(p.text)
        for msg in p.messages or []:
            texts.add(msg["content"])
    return texts


def write_prompt_file(path: Path, rows: list[dict]) -> None:
    """Prompt records as JSONL, gzipped when the name ends in .gz (the ship parts carry prompt
    files that way; the prompt loader reads either)."""
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["math", "code"], required=True)
    ap.add_argument("--n", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--exclude", type=Path, action="append", default=[],
                    help="a prompt file whose texts to leave out too (repeatable): a second file of fresh prompts, after a first")
    ap.add_argument("--no-mirrors", action="store_true",
                    help="math: leave out the problem families whose wording mirrors a held-out built-in prompt (MIRROR_FAMILIES)")
    a = ap.parse_args(argv)
    exclude = builtin_texts(a.kind)
    for path in a.exclude:
        exclude |= file_texts(path)
    try:
        if a.kind == "math":
            rows = synthetic_math_prompts(a.n, a.seed, exclude, mirrors=not a.no_mirrors)
        else:
            rows = synthetic_code_prompts(a.n, a.seed, exclude)
    except ValueError as e:
        ap.error(str(e))
    write_prompt_file(a.out, rows)
    print(f"{len(rows)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
