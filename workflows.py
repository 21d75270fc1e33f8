r"""Multi-agent LLM workflows as plain Python: who speaks, with which prompt, in which order.

An agent has a *slot* (generator0, evaluator, worker2, ...) and a *role type* (generator, ...);
slots of one role type share a prompt and, under isolated adapters, a LoRA adapter. A workflow
never touches tensors: it calls `generate(role, slots, episodes, chats)` once per stage, and the
callback (rollout.py) batches the stage into one model call. Paper A (Zeng et al. 2026,
arXiv 2605.24202):
  single        generator                                    final = generator
  eval_opt      generator -> evaluator -> generator -> ...   final = last generator turn
  voting        N generators -> aggregator picks \boxed{k}   final = candidate k
  orch_workers  orchestrator -> N workers -> synthesizer     final = synthesizer
The evaluator answers \boxed{Correct} / \boxed{Incorrect} and the orchestrator lists strategies;
neither solves. `adherence` and `similarity` are the signals of role capture.

Departures: the prompts are this project's own, short enough for a 135M model; a verdict without
\boxed{} falls back to the last word "correct"/"incorrect", else Incorrect; eval_opt skips the
evaluator after the last turn; texts fed to a later role keep head and tail (MAX_FEED_CHARS).

Exercised by: pytest tests/test_workflows.py, and `python workflows.py voting` (every stage's
prompts for one question, from a canned fake model).
"""
import re
import sys
from dataclasses import dataclass
from functools import partial
from string import Template
from typing import Callable

Chat = list[dict[str, str]]  # [{"role": "system", ...}, {"role": "user", ...}]
GenerateFn = Callable[[str, list[str], list[int], list[Chat]], list[str]]

MAX_FEED_CHARS = 1500  # a rambling agent must not blow up the next agent's prompt
DEFAULT_STRATEGY = "Solve it directly, step by step."  # for workers the orchestrator left out

# Prompts keyed by (kind, role type); the generator's "refine" is its eval_opt turn after an
# Incorrect verdict. string.Template ($question): the braces of \boxed{} need no escaping.
PROMPTS: dict[tuple[str, str], dict[str, str]] = {
    ("math", "generator"): {
        "system": "You are a careful math solver. Write the calculation in one line, then the "
                  "final answer in \\boxed{}. Example: 4 + 5 = 9, so the answer is \\boxed{9}.",
        "user": "Problem: $question",
        "refine": "Problem: $question\n\nYour previous solution:\n$solution\n\n"
                  "A reviewer said it is incorrect:\n$critique\n\n"
                  "Check the calculation. Write the corrected solution in one line, or the same "
                  "one if it was right. End with the final answer in \\boxed{}.",
    },
    ("math", "evaluator"): {
        "system": "You are a strict math reviewer. Check whether a solution is correct. "
                  "Do not solve the problem and do not give the answer. Write at most two "
                  "short sentences, then \\boxed{Correct} or \\boxed{Incorrect}.",
        "user": "Problem: $question\n\nSolution to check:\n$solution\n\n"
                "Is it correct? End with \\boxed{Correct} or \\boxed{Incorrect}.",
    },
    ("math", "aggregator"): {
        "system": "You are a judge. You see a problem and $n numbered candidate solutions. "
                  "Pick the candidate most likely to be correct. Reply only with its "
                  "number in \\boxed{}, for example \\boxed{2}.",
        "user": "Problem: $question\n\n$candidates\n\n"
                "Which candidate is correct? Reply with \\boxed{k}, k from 1 to $n.",
    },
    ("math", "orchestrator"): {
        "system": "You are a planner. Do not solve the problem and do not compute the answer. "
                  "List up to $n different strategies to solve it, one short sentence each, "
                  "numbered 1., 2., 3.",
        "user": "Problem: $question\n\nList up to $n numbered strategies.",
    },
    ("math", "worker"): {
        "system": "You are a math solver. Solve the problem step by step using the given "
                  "strategy. End with the final answer in \\boxed{}, for example \\boxed{42}.",
        "user": "Problem: $question\n\nStrategy: $strategy",
    },
    ("math", "synthesizer"): {
        "system": "You are a senior math solver. You see a problem and solutions from other "
                  "solvers. Check them, decide which answer is right, and explain briefly. "
                  "End with the final answer in \\boxed{}, for example \\boxed{42}.",
        "user": "Problem: $question\n\n$solutions\n\n"
                "What is the correct final answer? End with \\boxed{}.",
    },
    # Code: the reward runs the last ```python block of the final text against hidden tests.
    ("code", "generator"): {
        "system": "You are a careful Python programmer. Solve the task with complete, runnable "
                  "Python code, imports included. Write all of it in one block that starts with "
                  "```python and ends with ```.",
        "user": "Task:\n$question",
        "refine": "Task:\n$question\n\nYour previous solution:\n$solution\n\n"
                  "A reviewer said it is incorrect:\n$critique\n\n"
                  "Write a corrected solution in one ```python block.",
    },
    ("code", "evaluator"): {
        "system": "You are a strict code reviewer. Check whether a Python solution solves the "
                  "task. Do not write any code and do not fix the solution. Write at most two "
                  "short sentences, then \\boxed{Correct} or \\boxed{Incorrect}.",
        "user": "Task:\n$question\n\nSolution to check:\n$solution\n\n"
                "Is it correct? End with \\boxed{Correct} or \\boxed{Incorrect}.",
    },
    ("code", "aggregator"): {
        "system": "You are a judge. You see a programming task and $n numbered candidate "
                  "solutions. Pick the candidate most likely to pass all the tests. Reply only "
                  "with its number in \\boxed{}, for example \\boxed{2}.",
        "user": "Task:\n$question\n\n$candidates\n\n"
                "Which candidate is correct? Reply with \\boxed{k}, k from 1 to $n.",
    },
    ("code", "orchestrator"): {
        "system": "You are a planner. Do not write code and do not solve the task. "
                  "List up to $n different approaches to solve it, one short sentence each, "
                  "numbered 1., 2., 3.",
        "user": "Task:\n$question\n\nList up to $n numbered approaches.",
    },
    ("code", "worker"): {
        "system": "You are a Python programmer. Solve the task using the given approach. Write "
                  "complete, runnable Python code in one block that starts with ```python and "
                  "ends with ```.",
        "user": "Task:\n$question\n\nApproach: $strategy",
    },
    ("code", "synthesizer"): {
        "system": "You are a senior Python programmer. You see a task and solutions from other "
                  "programmers. Check them, then write the final, correct solution: complete, "
                  "runnable Python code in one block that starts with ```python and ends with ```.",
        "user": "Task:\n$question\n\n$solutions\n\n"
                "Write the final solution in one ```python block.",
    },
}
KINDS = sorted({kind for kind, _ in PROMPTS})

ROLES: dict[str, list[str]] = {
    "single": ["generator"],
    "eval_opt": ["generator", "evaluator"],
    "voting": ["generator", "aggregator"],
    "orch_workers": ["orchestrator", "worker", "synthesizer"],
}
SOLVERS = ("generator", "worker", "synthesizer")  # the roles whose output is a solution


@dataclass
class Outcome:
    final: str  # the text the reward scores (its last \boxed{} is the answer)
    # for logs: "fallback" (a broken contract), "rule" (what decided the answer; not in single),
    # eval_opt "rounds" and "stopped", voting "choice", orch_workers "strategies" (parsed)
    info: dict


# ---------------------------------------------------------------- names and prompts

def slots(name: str, n_agents: int = 3) -> list[str]:
    """Agent slots of a workflow, in stage order: voting -> generator0..2, aggregator."""
    check_name(name)
    if name == "voting":
        return [f"generator{i}" for i in range(n_agents)] + ["aggregator"]
    if name == "orch_workers":
        return ["orchestrator"] + [f"worker{i}" for i in range(n_agents)] + ["synthesizer"]
    return {"single": ["generator"], "eval_opt": ["generator", "evaluator"]}[name]


def role_of(slot: str) -> str:
    """Role type of a slot: "generator1" -> "generator", "evaluator" -> "evaluator"."""
    role = re.sub(r"\d+$", "", slot)
    if role not in {r for roles in ROLES.values() for r in roles}:
        raise ValueError(f"unknown agent slot {slot!r}")
    return role


def check_name(name: str) -> None:
    if name not in WORKFLOWS:
        raise ValueError(f"unknown workflow {name!r}; known: {', '.join(WORKFLOWS)}")


def chat(kind: str, role: str, turn: str = "user", **fields: object) -> Chat:
    """System + user messages for one call; `fields` fill the $placeholders."""
    templates = PROMPTS[(kind, role)]
    return [{"role": "system", "content": Template(templates["system"]).substitute(fields)},
            {"role": "user", "content": Template(templates[turn]).substitute(fields)}]


def clip(text: str, limit: int = MAX_FEED_CHARS) -> str:
    """Keep the head (the approach) and the tail (the answer) of a long text."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + "\n[...]\n" + text[-half:]


def numbered(label: str, texts: list[str]) -> str:
    return "\n\n".join(f"{label} {i}:\n{clip(t)}" for i, t in enumerate(texts, 1))


def stage(generate: GenerateFn, role: str, calls: list[tuple[str, int, Chat]]) -> list[str]:
    """All (slot, episode, chat) calls of one role type in one generate call."""
    slot_list, episodes, chats = (list(column) for column in zip(*calls))
    outs = generate(role, slot_list, episodes, chats)
    if len(outs) != len(chats):
        raise RuntimeError(f"generate returned {len(outs)} texts for {len(chats)} {role} calls")
    return list(outs)


# ---------------------------------------------------------------- parsing role contracts
# Each parser returns what it read and the rule that read it: a drift shows in the logs.

BOXED = re.compile(r"\\boxed\s*\{")
BRACE = re.compile(r"[{}]")


def boxed_contents(text: str) -> list[str]:
    r"""Contents of every \boxed{...} whose braces close, in order, nested braces included."""
    starts = [m.end() - 1 for m in BOXED.finditer(text)]  # positions of the opening '{'
    if not starts:
        return []
    stack, close = [], {}  # one pass pairs every brace: a scan per \boxed would be quadratic
    for m in BRACE.finditer(text, starts[0]):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            close[stack.pop()] = m.start()
    return [text[s + 1:close[s]] for s in starts if s in close]


VERDICT = re.compile(r"\b(incorrect|correct)\b", re.IGNORECASE)  # the contract's two words
SAID = re.compile(r"\b(not\s+correct|incorrect|correct)\b", re.IGNORECASE)  # "not correct" too


def parse_verdict(text: str) -> tuple[bool, str]:
    """(is_correct, rule): "boxed", "word" (the last; "not correct" too) or "default" (false)."""
    for content in reversed(boxed_contents(text)):
        words = SAID.findall(content)
        if words:
            return words[-1].lower() == "correct", "boxed"
    words = SAID.findall(text)
    if words:
        return words[-1].lower() == "correct", "word"
    return False, "default"


def reasons(verdict: str) -> str:
    r"""An evaluator's output without its boxed verdict, the critique a refine reads: a bare
    \boxed{Incorrect} left in it is what a small model on a shared adapter copies."""
    return re.sub(r"\\boxed\s*\{\s*(?:in)?correct\s*\}", "", verdict,
                  flags=re.IGNORECASE).strip() or "(no reason given)"


def parse_choice(text: str, n: int) -> tuple[int, str]:
    r"""(k, rule), 1 <= k <= n: last valid \boxed{k}, else the first digit 1..n, else 1."""
    for content in reversed(boxed_contents(text)):
        if content.strip().isdecimal() and 1 <= int(content.strip()) <= n:
            return int(content.strip()), "boxed"
    for m in re.finditer(r"[0-9]", text):
        if 1 <= int(m.group()) <= n:
            return int(m.group()), "first_digit"
    return 1, "default"


STRATEGY_LINE = re.compile(r"^[\s#*-]*(?:strategy\s*)?\d+\s*[.):](?!\d)[\s*]*(\S.*)$",
                           re.IGNORECASE | re.MULTILINE)


def parse_strategies(text: str, n: int) -> list[str]:
    """The first n numbered lines: "1. ...", "2) ...", "Strategy 3: ..."."""
    return [clip(m.group(1).strip(" *")) for m in STRATEGY_LINE.finditer(text)][:n]


# ---------------------------------------------------------------- role-capture signals

SHORT_VERDICT = 300  # characters: "at most two short sentences, then the verdict"
SHORT_CHOICE = 60    # characters: a bare \boxed{k} with a word or two around it


def adherence(role: str, text: str, n: int = 3) -> bool | None:
    r"""Does this output keep its role's contract? None for free-form roles. evaluator: a boxed
    verdict, no other boxed answer, short; aggregator: a valid \boxed{k}, short; orchestrator:
    numbered strategies and no boxed answer (it must not solve)."""
    if role == "evaluator":
        boxed = boxed_contents(text)
        only_verdicts = all(VERDICT.fullmatch(b.strip()) for b in boxed)
        return bool(boxed) and only_verdicts and len(text) <= SHORT_VERDICT
    if role == "aggregator":
        return parse_choice(text, n)[1] == "boxed" and len(text) <= SHORT_CHOICE
    if role == "orchestrator":
        return bool(parse_strategies(text, n)) and not boxed_contents(text)
    return None


def ngrams(text: str, n: int = 3) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def similarity(texts_a: list[str], texts_b: list[str], n: int = 3) -> float:
    """Jaccard overlap of the word n-grams of two sets of outputs: 0 disjoint, 1 same."""
    a = set().union(*(ngrams(t, n) for t in texts_a))
    b = set().union(*(ngrams(t, n) for t in texts_b))
    return len(a & b) / len(a | b) if a | b else 0.0


# ---------------------------------------------------------------- the workflows

def single(questions: list[str], generate: GenerateFn, kind: str,
           n_agents: int, max_rounds: int) -> list[Outcome]:
    calls = [("generator", e, chat(kind, "generator", question=q)) for e, q in enumerate(questions)]
    return [Outcome(final=out, info={"fallback": False})
            for out in stage(generate, "generator", calls)]


def eval_opt(questions: list[str], generate: GenerateFn, kind: str,
             n_agents: int, max_rounds: int) -> list[Outcome]:
    """Generator and evaluator alternate; each episode stops on its own first Correct."""
    solution, critique = [""] * len(questions), [""] * len(questions)
    info = [{"rounds": 0, "stopped": False, "fallback": False, "rule": "none"} for _ in questions]
    active = list(range(len(questions)))
    for turn in range(max_rounds):
        calls = [("generator", e, chat(kind, "generator", "refine" if turn else "user",
                                       question=questions[e], solution=clip(solution[e]),
                                       critique=clip(critique[e]))) for e in active]
        for e, out in zip(active, stage(generate, "generator", calls)):
            solution[e] = out
            info[e]["rounds"] += 1
        if turn == max_rounds - 1:
            break  # a verdict on the last turn could not change the final answer
        calls = [("evaluator", e, chat(kind, "evaluator", question=questions[e],
                                       solution=clip(solution[e]))) for e in active]
        for e, out in zip(active, stage(generate, "evaluator", calls)):
            info[e]["stopped"], info[e]["rule"] = parse_verdict(out)  # of the last verdict
            info[e]["fallback"] |= info[e]["rule"] != "boxed"
            critique[e] = reasons(out)
        active = [e for e in active if not info[e]["stopped"]]
        if not active:
            break
    return [Outcome(final=s, info=i) for s, i in zip(solution, info)]


def voting(questions: list[str], generate: GenerateFn, kind: str,
           n_agents: int, max_rounds: int) -> list[Outcome]:
    """N generators answer the same prompt independently; an aggregator picks one."""
    gen_slots = [f"generator{i}" for i in range(n_agents)]
    calls = [(s, e, chat(kind, "generator", question=q)) for e, q in enumerate(questions)
             for s in gen_slots]
    outs = stage(generate, "generator", calls)
    candidates = [outs[e * n_agents:(e + 1) * n_agents] for e in range(len(questions))]
    calls = [("aggregator", e, chat(kind, "aggregator", question=q, n=n_agents,
                                    candidates=numbered("Candidate", candidates[e])))
             for e, q in enumerate(questions)]
    outcomes = []
    for e, out in enumerate(stage(generate, "aggregator", calls)):
        k, rule = parse_choice(out, n_agents)
        outcomes.append(Outcome(final=candidates[e][k - 1],
                                info={"choice": k, "rule": rule, "fallback": rule != "boxed"}))
    return outcomes


def orch_workers(questions: list[str], generate: GenerateFn, kind: str,
                 n_agents: int, max_rounds: int) -> list[Outcome]:
    """Orchestrator plans strategies, worker i follows strategy i, a synthesizer answers."""
    calls = [("orchestrator", e, chat(kind, "orchestrator", question=q, n=n_agents))
             for e, q in enumerate(questions)]
    plans = [parse_strategies(out, n_agents) for out in stage(generate, "orchestrator", calls)]
    strategies = [p + [DEFAULT_STRATEGY] * (n_agents - len(p)) for p in plans]
    calls = [(f"worker{i}", e, chat(kind, "worker", question=q, strategy=strategies[e][i]))
             for e, q in enumerate(questions) for i in range(n_agents)]
    outs = stage(generate, "worker", calls)
    solutions = [outs[e * n_agents:(e + 1) * n_agents] for e in range(len(questions))]
    calls = [("synthesizer", e, chat(kind, "synthesizer", question=q,
                                     solutions=numbered("Solution", solutions[e])))
             for e, q in enumerate(questions)]
    return [Outcome(final=out, info={"strategies": len(p), "fallback": len(p) < n_agents,
                                     "rule": "numbered" if len(p) == n_agents else "default"})
            for out, p in zip(stage(generate, "synthesizer", calls), plans)]


WORKFLOWS: dict[str, Callable[[list[str], GenerateFn, str, int, int], list[Outcome]]] = {
    "single": single, "eval_opt": eval_opt, "voting": voting, "orch_workers": orch_workers,
}


def run_workflow(name: str, questions: list[str], generate: GenerateFn, kind: str = "math",
                 n_agents: int = 3, max_rounds: int = 2) -> list[Outcome]:
    """Run workflow `name` on every question; one Outcome per question (= per episode)."""
    check_name(name)
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(KINDS)}")
    if n_agents < 1 or max_rounds < 1:
        raise ValueError(f"need n_agents >= 1 and max_rounds >= 1, got {n_agents}, {max_rounds}")
    if not questions:
        return []
    return WORKFLOWS[name](questions, generate, kind, n_agents, max_rounds)


def every_prompt(name: str, question: str, kind: str = "math", n_agents: int = 3,
                 max_rounds: int = 2) -> list[Chat]:
    """Every prompt workflow `name` builds for `question` when the agents write nothing."""
    chats: list[Chat] = []
    run_workflow(name, [question], partial(silent_agents, chats), kind, n_agents, max_rounds)
    return chats


def silent_agents(chats: list[Chat], role: str, slot_list: list[str], episodes: list[int],
                  new: list[Chat]) -> list[str]:
    """A generate callback that keeps the prompts in `chats` and answers each with ""."""
    chats += new
    return [""] * len(new)


# ---------------------------------------------------------------- demo: python workflows.py NAME

CANNED = {"generator": "2 + 3 = 5, so the answer is \\boxed{5}.",
          "evaluator": "The arithmetic checks out. \\boxed{Correct}",
          "aggregator": "\\boxed{2}",
          "orchestrator": "1. Add the numbers directly.\n2. Count up from the larger number.",
          "worker": "Following the strategy: 2 + 3 = 5. \\boxed{5}",
          "synthesizer": "Both solutions agree. \\boxed{5}"}


def echo_generate(role: str, slot_list: list[str], episodes: list[int],
                  chats: list[Chat]) -> list[str]:
    """A fake model that prints each stage's first prompt and answers from CANNED."""
    print(f"=== stage: {role} x{len(chats)}  slots {slot_list}  episodes {episodes}")
    for message in chats[0]:
        print(f"--- {message['role']}:\n{message['content']}")
    return [CANNED[role]] * len(chats)


if __name__ == "__main__":
    if len(sys.argv) > 2 or sys.argv[1:] and sys.argv[1] not in ROLES:
        raise SystemExit(f"usage: python workflows.py [{' | '.join(ROLES)}] (default: voting)")
    name = sys.argv[1] if len(sys.argv) > 1 else "voting"
    for outcome in run_workflow(name, ["What is 2 + 3?"], echo_generate):
        print(f"=== final: {outcome.final!r}  info: {outcome.info}")
