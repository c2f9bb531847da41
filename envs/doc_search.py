"""DocSearch-v0: find a fact in a generated corpus of long documents with ``search`` and ``open`` tools.

Each task has its own corpus of ``hops + num_distractors`` long dossiers, one per (invented) project. The question
asks for a project's access code; the project's dossier says, deep inside, in which other project's dossier its
records continue, ``hops - 1`` times, and the last dossier states the code. Distractor dossiers state decoy codes.
``search`` only sees titles and abstracts, so the model must page through documents with ``open``: observations
are long (``page_chars`` per call) and episodes have many turns.

Length is tunable: ``context_tokens`` (default 32K) sizes the documents so that the oracle's trajectory, reading
every dossier on the chain from the start until the fact appears, is 1.0-1.5x that many tokens (estimated as
characters / 4); 262144 gives 256K-1M-character trajectories. The budgets (``max_turns``, the observation
budget) scale with it. Documents are generated on demand from the task row, so a task set stays small.

Reward: ``correct`` = exact match with the code. Oracle: per hop, search the project, then open pages in order
until the page that contains the fact; then the answer.
"""

from __future__ import annotations

import json
import math
import random
import re
from typing import TYPE_CHECKING, Any, Mapping

from agentrl.envs.errors import ToolError
from agentrl.envs.tool_env import ToolEnv, load_tasks
from agentrl.envs.tools import tool
from agentrl.envs.turns import AssistantTurn, answer, call
from agentrl.reward import exact_match

if TYPE_CHECKING:
    import datasets

CHARS_PER_TOKEN = 4  # the estimate used to size documents for a token target
_NEEDLE_SPAN = (0.6, 0.9)  # where in a dossier (fraction of its length) the fact sits
_SYLLABLES = ["val", "mor", "tes", "quin", "dra", "lo", "ver", "an", "thi", "kos", "mel", "ru", "zan", "pel", "or",
              "ix", "bel", "na", "sor", "gue"]
_WORDS = ("the a of and to in for on with by from as at report survey team budget review meeting plan quarter "
          "supplier schedule inventory field sample measurement result analysis storage transport region office "
          "staff training policy update summary note committee archive record ledger request approval delay "
          "shipment vehicle engine pressure temperature reading sensor calibration network cable panel module "
          "north south east west coastal inland weekly monthly annual early late several many few most certain "
          "minor major routine careful detailed brief formal informal revised final draft pending approved "
          "delayed completed noted observed recorded reported planned reviewed checked confirmed moved held "
          "opened closed sent received listed filed signed counted measured tested adjusted replaced repaired "
          "because although while after before during under over between within without about again also then "
          "still often rarely usually").split()


def _project_names(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize())
    return sorted(names)


def _code(rng: random.Random) -> str:
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    pair = lambda: rng.choice(letters) + rng.choice(letters)  # noqa: E731
    return f"{pair()}-{rng.randint(1000, 9999)}-{pair()}"


def doc_chars_for(context_tokens: int, hops: int) -> int:
    """Document length that makes the oracle read at least ``context_tokens`` tokens in ``hops`` documents."""
    return math.ceil(context_tokens * CHARS_PER_TOKEN / (hops * _NEEDLE_SPAN[0]))


def generate_tasks(num_tasks: int = 200, seed: int = 0, *, hops: int = 2, context_tokens: int = 32_768,
                   num_distractors: int = 6) -> datasets.Dataset:
    """Columns: id, question, answer, doc_chars, docs (JSON list of {title, abstract, fact, fact_at}), chain."""
    import datasets

    if num_tasks <= 0 or hops <= 0 or context_tokens <= 0 or num_distractors < 0:
        raise ValueError(f"need num_tasks, hops, context_tokens > 0 and num_distractors >= 0; got {num_tasks!r}, "
                         f"{hops!r}, {context_tokens!r}, {num_distractors!r}")
    rows = []
    for i in range(num_tasks):
        rng = random.Random(f"docsearch:{seed}:{hops}:{context_tokens}:{i}")
        names = _project_names(rng, hops + num_distractors)
        rng.shuffle(names)
        order = list(range(len(names)))
        rng.shuffle(order)  # order[j]: the doc index of project names[j]
        answer = _code(rng)
        docs: list[dict[str, Any]] = [{} for _ in names]
        for j, name in enumerate(names):
            if j < hops - 1:
                fact = f"Records for Project {name} continue in the dossier of Project {names[j + 1]}."
            elif j == hops - 1:
                fact = f"The access code for Project {name} is {answer}."
            else:
                fact = f"The access code for Project {name} is {_code(rng)}."
            topic = " ".join(rng.sample(_WORDS[20:], 4))
            docs[order[j]] = {"title": f"Dossier on Project {name}", "fact": fact,
                              "abstract": f"This dossier covers Project {name}: {topic}.",
                              "fact_at": rng.uniform(*_NEEDLE_SPAN)}
        rows.append({"id": f"docsearch-{seed}-{i}", "answer": answer, "doc_chars": doc_chars_for(context_tokens, hops),
                     "question": f"What is the access code for Project {names[0]}? Its records may continue in "
                                 "other dossiers; follow them.",
                     "docs": json.dumps(docs), "chain": json.dumps([order[j] for j in range(hops)])})
    return datasets.Dataset.from_list(rows)


def render_document(task: Mapping[str, Any], index: int) -> str:
    """The full text of document ``index`` of ``task``: deterministic, ``doc_chars`` long, fact included once."""
    doc = json.loads(task["docs"])[index]
    rng = random.Random(f"{task['id']}:doc:{index}")
    length, fact_at = task["doc_chars"], int(doc["fact_at"] * task["doc_chars"])
    parts, size, placed = [f"{doc['title']}\n\n{doc['abstract']}\n\n"], 0, False
    size = len(parts[0])
    while size < length:
        if not placed and size >= fact_at:
            parts.append(doc["fact"] + "\n\n")
            placed = True
        words = rng.choices(_WORDS, k=rng.randint(40, 110))
        sentences = [" ".join(words[k:k + 10]).capitalize() + "." for k in range(0, len(words), 10)]
        parts.append(" ".join(sentences) + "\n\n")
        size += len(parts[-1])
    if not placed:
        parts.append(doc["fact"] + "\n\n")
    return "".join(parts)


class DocSearchEnv(ToolEnv):
    """Question answering over long generated documents."""

    instructions = ("search() finds dossiers by title and abstract only; read a dossier with open(), page by page "
                    "(each page tells you the next offset). Answer with just the access code.")

    def __init__(self, tasks: Any = None, *, num_tasks: int = 200, task_seed: int = 0, hops: int = 2,
                 context_tokens: int = 32_768, num_distractors: int = 6, page_chars: int = 8_000,
                 max_turns: int | None = None, max_observation_chars: int | None = None, **kwargs: Any) -> None:
        if page_chars <= 0:
            raise ValueError(f"page_chars must be > 0, got {page_chars!r}")
        tasks = load_tasks(tasks) if tasks is not None else generate_tasks(
            num_tasks, task_seed, hops=hops, context_tokens=context_tokens, num_distractors=num_distractors)
        first = tasks[0]
        doc_chars, chain_len = int(first["doc_chars"]), len(json.loads(first["chain"]))
        pages = math.ceil(doc_chars / page_chars)
        self.page_chars = page_chars
        # Budgets: enough to read every dossier on the chain in full once, plus searches and slack.
        kwargs.setdefault("max_tool_output_chars", page_chars + 200)
        super().__init__(tasks, max_turns=max_turns or chain_len * (pages + 3) + 8,
                         max_observation_chars=max_observation_chars or chain_len * (doc_chars + 20 * page_chars),
                         **kwargs)
        self._docs: dict[tuple[str, int], str] = {}

    def _document(self, index: int) -> str:
        key = (self.task["id"], index)
        if key not in self._docs:
            if len(self._docs) >= 16:  # only the current task's documents are worth keeping
                self._docs.clear()
            self._docs[key] = render_document(self.task, index)
        return self._docs[key]

    @tool
    def search(self, query: str) -> str:
        """Search the dossiers' titles and abstracts; returns up to 5 matches as doc id, title and length.

        Args:
            query: words to look for, e.g. a project name.
        """
        terms = set(re.findall(r"\w+", query.lower()))
        if not terms:
            raise ToolError("the query has no words")
        docs = json.loads(self.task["docs"])
        scored = []
        for i, doc in enumerate(docs):
            hits = len(terms & set(re.findall(r"\w+", f"{doc['title']} {doc['abstract']}".lower())))
            if hits:
                scored.append((-hits, i))
        if not scored:
            return "No dossiers match."
        return "\n".join(f"doc-{i:03d}\t{docs[i]['title']}\t{self.task['doc_chars']} characters"
                         for _, i in sorted(scored)[:5])

    @tool(name="open")
    def open_document(self, doc_id: str, offset: int = 0) -> str:
        """Read one page of a dossier starting at a character offset.

        Args:
            doc_id: a document id from search, e.g. "doc-004".
            offset: the character offset to start reading at; each page says where the next one starts.
        """
        match = re.fullmatch(r"doc-(\d{3})", doc_id.strip())
        num_docs = len(json.loads(self.task["docs"]))
        if match is None or int(match.group(1)) >= num_docs:
            raise ToolError(f"no document {doc_id[:40]!r}; ids run from doc-000 to doc-{num_docs - 1:03d}")
        text = self._document(int(match.group(1)))
        if not 0 <= offset < len(text):
            raise ToolError(f"offset must be in [0, {len(text)}), got {offset}")
        end = min(offset + self.page_chars, len(text))
        where = f"next offset {end}" if end < len(text) else "end of document"
        return f"[{doc_id.strip()}: characters {offset}-{end} of {len(text)}; {where}]\n{text[offset:end]}"

    def prompt(self, task: Mapping[str, Any]) -> str:
        return task["question"]

    def score(self, task: Mapping[str, Any], answer: str) -> dict[str, float]:
        return {"correct": exact_match(answer, task["answer"])}

    def oracle(self, task: Mapping[str, Any]) -> list[AssistantTurn]:
        docs, turns = json.loads(task["docs"]), []
        for index in json.loads(task["chain"]):
            name = docs[index]["title"].removeprefix("Dossier on Project ")
            turns.append(call("search", query=f"Project {name}"))
            text = render_document(task, index)
            fact_end = text.index(docs[index]["fact"]) + len(docs[index]["fact"])
            for offset in range(0, fact_end, self.page_chars):
                turns.append(call("open", doc_id=f"doc-{index:03d}", offset=offset))
        return [*turns, answer(task["answer"])]
