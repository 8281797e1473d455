"""Synthetic chat instructions for training a DFlash drafter by
self-distillation (scripts/train_dflash.py): prose, code, JSON, math, tool
calls, editing and extraction, made from templates and fillers with a seed,
and tasks over real code: functions of Python's own standard library
(renamed, documented, explained, quoted line by line) and generated
configuration files. None of them is a prompt of the evaluation sets
(bench/prompts/mixed.jsonl, the real-text bench's own prompts).
"""

import ast
import json
import random
import sysconfig
from functools import lru_cache
from pathlib import Path

TOPICS = [
    "volcanoes", "the printing press", "honey bees", "glaciers", "the Roman road network",
    "solar panels", "coral reefs", "the history of chess", "public libraries", "bicycles",
    "tea ceremonies", "lighthouses", "desert plants", "the water cycle", "urban gardens",
    "jazz music", "deep sea fish", "paper money", "the night sky", "mountain railways",
    "recycling", "ancient Egypt", "electric cars", "weather forecasting", "bread baking",
    "migratory birds", "wind turbines", "the human heart", "origami", "board games",
    "rainforests", "submarines", "the telephone", "coffee farming", "earthquakes",
    "vaccines", "the Silk Road", "photosynthesis", "museums", "hot air balloons",
]
AUDIENCES = ["a child", "a beginner", "a busy manager", "a high school student", "an expert", "a tourist"]
STYLES = ["in three sentences", "in one paragraph", "as a bulleted list", "in a friendly tone",
          "in simple words", "with one concrete example", "in under 80 words", "as a short poem"]
PLACES = ["a mountain village", "a busy train station", "an old bookshop", "a night market",
          "a snowy forest", "a space station", "a desert oasis", "a rainy city street", "a farm in spring"]
PEOPLE = ["a retired teacher", "a young inventor", "a lost robot", "a street musician",
          "a ship's cook", "a curious cat", "a night-shift nurse", "a beekeeper"]
LANGS = ["Python", "JavaScript", "Rust", "Go", "C", "TypeScript", "Java", "Bash"]
CODE_TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome",
    "counts the vowels in a string", "returns the n-th Fibonacci number",
    "computes the greatest common divisor of two integers", "flattens a nested list",
    "removes duplicates from a list while keeping the order", "parses a date in YYYY-MM-DD format",
    "finds the largest element of an array", "converts Celsius to Fahrenheit",
    "checks whether a number is prime", "sums the digits of an integer",
    "groups words by their first letter", "returns the k most frequent items",
    "validates an email address with a simple rule", "computes a running average",
    "reads a text file and counts its lines", "capitalizes the first letter of every word",
    "merges two sorted lists", "computes the factorial of n iteratively",
]
FIRST = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lena"]
LAST = ["Smith", "Rossi", "Wang", "Novak", "Okafor", "Haddad", "Petrov", "Sato", "Garcia", "Müller"]
CITIES = ["Oslo", "Nairobi", "Lima", "Osaka", "Porto", "Krakow", "Austin", "Hanoi", "Dublin", "Quito"]
ITEMS = ["notebook", "desk lamp", "water bottle", "backpack", "headphones", "umbrella", "mug", "keyboard"]
UNITS = ["km", "liters", "kg", "meters", "hours", "apples", "pages", "euros"]


def person(r):
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def prose(r):
    t = r.choice(TOPICS)
    forms = [
        f"Explain {t} to {r.choice(AUDIENCES)} {r.choice(STYLES)}.",
        f"Write a short story about {r.choice(PEOPLE)} in {r.choice(PLACES)}.",
        f"Describe {r.choice(PLACES)} at night {r.choice(STYLES)}.",
        f"Give three interesting facts about {t}.",
        f"What are the advantages and disadvantages of {t}? Answer {r.choice(STYLES)}.",
        f"Write a thank-you note to {person(r)} for helping with a project about {t}.",
        f"Summarize the history of {t} {r.choice(STYLES)}.",
        f"Write a product description for a {r.choice(ITEMS)} inspired by {t}.",
        f"List five tips for someone who wants to learn about {t}.",
        f"Compare {t} and {r.choice(TOPICS)} in a short paragraph.",
    ]
    return r.choice(forms)


def code(r):
    lang, task = r.choice(LANGS), r.choice(CODE_TASKS)
    forms = [
        f"Write a {lang} function that {task}.",
        f"In {lang}, write a function that {task}, with a short comment explaining it.",
        f"Show a {lang} example that {task}, and one call of it.",
        f"Write unit tests in {lang} for a function that {task}.",
        f"Explain step by step how you would write a {lang} function that {task}.",
    ]
    return r.choice(forms)


def json_prompt(r):
    p, city = person(r), r.choice(CITIES)
    age, n = r.randint(19, 80), r.randint(2, 6)
    forms = [
        f"Return a JSON object for a person named {p} from {city}, aged {age}, with keys name, city and age.",
        f"Produce a JSON array of {n} objects describing {r.choice(ITEMS)}s, each with fields id, color and price.",
        f"Write a JSON object describing a fictional movie about {r.choice(TOPICS)} with keys title, year, director and cast.",
        f"Convert to JSON with keys product, quantity and unit_price: {n} {r.choice(ITEMS)}s at {r.randint(3, 90)}.{r.randint(10, 99)} each.",
        f"Give a JSON configuration for a web server with host, port {r.randint(1024, 9999)}, log_level and a list of allowed_origins.",
        f"Output only JSON: an order from {p} containing {n} items with name and quantity.",
    ]
    return r.choice(forms)


def math(r):
    a, b, c = r.randint(2, 99), r.randint(2, 99), r.randint(2, 20)
    u = r.choice(UNITS)
    forms = [
        f"What is {a} times {b}? Show your work.",
        f"A shop sells {a} {u} on Monday and {b} {u} on Tuesday. How many {u} in total, and what is the average per day?",
        f"Solve for y: {c}y + {a} = {b + c * a}. Explain each step.",
        f"If {p_of(r)} of {a * 4} is taken away, how much remains? Explain.",
        f"A car drives {a * 3} km in {c} hours. What is its average speed? Show the steps.",
        f"What is the remainder when {a * b + c} is divided by {c}? Reason step by step.",
        f"Compute the area and perimeter of a rectangle of {a} cm by {b} cm.",
        f"Is {a * 2 + 1} a prime number? Explain how you check.",
    ]
    return r.choice(forms)


def p_of(r):
    return r.choice(["a quarter", "half", "a third", "three quarters"])


TOOLS = [
    {"name": "search_web", "description": "Search the web", "parameters": {"query": "string"}},
    {"name": "get_stock_price", "description": "Latest stock price", "parameters": {"symbol": "string"}},
    {"name": "send_email", "description": "Send an email", "parameters": {"to": "string", "subject": "string", "body": "string"}},
    {"name": "create_reminder", "description": "Create a reminder", "parameters": {"text": "string", "time": "string"}},
    {"name": "translate", "description": "Translate text", "parameters": {"text": "string", "target_language": "string"}},
    {"name": "get_time", "description": "Current time in a city", "parameters": {"city": "string"}},
]


def tool_call(r):
    tools = r.sample(TOOLS, 3)
    tool = r.choice(tools)
    asks = {
        "search_web": f"Find recent news about {r.choice(TOPICS)}.",
        "get_stock_price": f"What is the price of {r.choice(['ACME', 'GLOBX', 'INITech', 'UMBR'])} stock?",
        "send_email": f"Email {person(r)} that the meeting moves to {r.randint(9, 17)}:00.",
        "create_reminder": f"Remind me to buy a {r.choice(ITEMS)} tomorrow at {r.randint(7, 20)}:30.",
        "translate": f"Translate 'good morning, {r.choice(FIRST)}' into {r.choice(['French', 'Spanish', 'German', 'Italian'])}.",
        "get_time": f"What time is it in {r.choice(CITIES)}?",
    }
    return (
        "You can call these tools:\n" + json.dumps(tools) + "\n\n"
        'Answer with one JSON object {"name": ..., "arguments": {...}} that calls the right tool.\n\n'
        "Request: " + asks[tool["name"]]
    )


def edit(r):
    p, city, item = person(r), r.choice(CITIES), r.choice(ITEMS)
    text = (
        f"Dear {p},\n\nthank you for your order of a {item}. It was shipped from {city} "
        f"on day {r.randint(1, 28)} and should arrive within {r.randint(2, 9)} days. "
        f"If anything is wrong, reply to this email.\n\nBest regards,\nThe shop team"
    )
    fn = r.choice(["price_total", "count_items", "mean_value"])
    snippet = (
        f"def {fn}(values):\n    result = 0\n    for v in values:\n        result += v\n"
        f"    return result\n"
    )
    forms = [
        f"Rewrite this email in a more formal tone, keeping all the facts:\n\n{text}",
        f"Fix the grammar of this text and return it unchanged otherwise:\n\n{text.replace('It was', 'It were')}",
        f"Rename the variable `result` to `total` in this function and return the full code:\n\n```python\n{snippet}```",
        f"Add type hints and a docstring to this function and return the whole function:\n\n```python\n{snippet}```",
        f"Translate this email into Spanish:\n\n{text}",
    ]
    return r.choice(forms)


def extract(r):
    rows = [
        f"{person(r)}, {r.choice(CITIES)}, {r.randint(20, 70)}, {r.choice(['engineer', 'teacher', 'chef', 'pilot', 'nurse'])}"
        for _ in range(r.randint(3, 6))
    ]
    log = "\n".join(
        f"2024-0{r.randint(1, 9)}-1{r.randint(0, 9)} {r.choice(['INFO', 'WARN', 'ERROR'])} "
        f"{r.choice(['db', 'api', 'cache', 'auth'])}: {r.choice(['timeout', 'ok', 'retry', 'denied'])}"
        for _ in range(r.randint(4, 7))
    )
    forms = [
        "Here are some records (name, city, age, job):\n\n" + "\n".join(rows)
        + "\n\nList only the names and cities, one per line.",
        "Convert these records (name, city, age, job) into a Markdown table:\n\n" + "\n".join(rows),
        "From this log, copy every ERROR line exactly:\n\n" + log,
        "Turn this log into a JSON array of objects with date, level, component and message:\n\n" + log,
        "Extract all the cities mentioned, without duplicates:\n\n" + "\n".join(rows),
    ]
    return r.choice(forms)


@lru_cache(maxsize=1)
def library_functions():
    """Functions of 6-30 lines from the standard library's top-level
    modules (sorted, so the pool is the same on the same Python), each with
    the names it assigns."""
    out = []
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            source = file.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not 6 <= node.end_lineno - node.lineno + 1 <= 30:
                continue
            text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            names = sorted({
                t.id for n in ast.walk(node) if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name) and len(t.id) > 2
            })
            out.append((text, names))
    return out


def library_code(r):
    text, names = r.choice(library_functions())
    block = f"```python\n{text}\n```"
    line = r.choice([l.strip() for l in text.splitlines() if len(l.strip()) > 12] or [text.splitlines()[0]])
    word = r.choice([w for w in line.replace("(", " ").replace(")", " ").split() if w.isidentifier()] or ["return"])
    forms = [
        f"Explain what this function does:\n\n{block}",
        f"Add a docstring to this function and return the whole function in a code block:\n\n{block}",
        f"Copy out, unchanged and in a code block, every line of this function that mentions `{word}`:\n\n{block}",
        f"Rewrite this function with type hints and return the complete function:\n\n{block}",
        f"Here is a function:\n\n{block}\n\nReturn it unchanged, then list the names it uses.",
    ]
    if names:
        old = r.choice(names)
        forms.append(
            f"Here is a function:\n\n{block}\n\nRename the variable `{old}` to `{old}_value` everywhere "
            "and return the complete updated function in a code block."
        )
    return r.choice(forms)


def config_file(r):
    sections = r.sample(["app", "db", "queue", "mail", "log", "auth", "storage", "metrics"], 3)
    keys = ["host", "port", "timeout", "retries", "enabled", "path", "level", "user", "pool", "ttl"]
    values = lambda: r.choice([str(r.randint(1, 9000)), f"{r.randint(1, 90)}s", "true", "false",
                               f"/var/{r.choice(ITEMS).replace(' ', '_')}", r.choice(CITIES).lower()])
    lines = [f"{s}.{k} = {values()}" for s in sections for k in r.sample(keys, r.randint(2, 4))]
    r.shuffle(lines)
    body = "```\n" + "\n".join(lines) + "\n```"
    keep = r.sample(sections, 2)
    forms = [
        f"Here is a configuration file:\n\n{body}\n\nCopy out, unchanged and in a code block, every line that starts with `{keep[0]}.`.",
        f"Sort the lines of this configuration file alphabetically and return them in a code block:\n\n{body}",
        f"Convert this configuration file into one JSON object with a nested object per section:\n\n{body}",
        f"Here is a configuration file:\n\n{body}\n\nReturn it with every `{keep[1]}.` line removed and the rest unchanged.",
    ]
    return r.choice(forms)


KINDS = [prose, prose, code, code, json_prompt, math, tool_call, edit, extract,
         library_code, library_code, config_file]


def prompts(n, seed):
    """`n` distinct user messages, reproducible from `seed`."""
    r = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        text = r.choice(KINDS)(r)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
