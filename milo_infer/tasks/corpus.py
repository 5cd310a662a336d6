"""Demonstrations, the way a task renders them, and a user's own corpus.

``load_corpus(path)`` + ``task_from_corpus(demos, template=..., anchor=...)``: a user's own JSONL or
CSV with ``input`` and ``output`` fields, no code needed. The benchmark sets are loaded by
`milo_infer.tasks.datasets`, into the same `Demonstration` and `TaskSpec`.

Math outputs end in "The answer is N." (`TaskSpec.answer_of` reads N back).
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .scoring import extract_number

SHIPPED_DATA = Path(__file__).resolve().parent / "data"  # the demo corpus and queries, shipped as package data
DEMO_CORPUS = SHIPPED_DATA / "demo_corpus.jsonl"
DEMO_QUERIES = SHIPPED_DATA / "demo_queries.jsonl"

GENERIC_TEMPLATE = "Input: {input}\nOutput: {output}\n\n"
# An anchor lists the labels only when there are few enough to read at a glance.
MAX_LABELS_IN_ANCHOR = 20
SYSTEM_SEPARATOR = "\n\n"  # between a system prompt and the anchor, and a request's own system message and its query

_FIELD = re.compile(r"\{(input|output)\}")
# What makes a user's output numeric: a bare number, or a stated "answer is N" / "#### N".
_NUMERIC_OUTPUT = re.compile(r"\s*-?\$?[\d,]*\.?\d+\s*|.*(answer is|####).*", re.IGNORECASE | re.DOTALL)


class CorpusError(ValueError):
    """A corpus file that cannot be read as demonstrations; the message names the file and line."""


@dataclass(frozen=True)
class Demonstration:
    """One input/output pair. ``id`` is unique within its corpus and stable across loads."""

    input: str
    output: str
    id: str


@dataclass(frozen=True)
class TaskSpec:
    """How a task's demonstrations and queries are written, and what kind of answer it expects.

    ``template`` holds ``{input}`` then ``{output}`` (no other fields; other braces are literal).
    The query is the template cut just before ``{output}``, trailing spaces removed, so the model's
    continuation is the answer. ``anchor`` is the instruction text put before all demonstrations.
    ``answer_kind`` is "label" (one of ``labels``) or "number". ``system`` is a system prompt written before the
    anchor (`anchor_text`), so a chat request whose system message is this one is answered exactly.
    """

    name: str
    template: str
    anchor: str
    answer_kind: str
    labels: tuple[str, ...] = field(default=())
    system: str = ""

    def __post_init__(self):
        fields = _FIELD.findall(self.template)
        if fields != ["input", "output"]:
            raise ValueError(
                f"task {self.name!r}: template must contain {{input}} then {{output}}, once each; got {self.template!r}"
            )
        if self.answer_kind not in ("label", "number"):
            raise ValueError(f"task {self.name!r}: answer_kind must be 'label' or 'number', not {self.answer_kind!r}")
        if self.answer_kind == "label" and not self.labels:
            raise ValueError(f"task {self.name!r}: a label task needs its list of labels")

    @property
    def anchor_text(self) -> str:
        """What the store's anchor encodes: the system prompt (if any), a blank line, then the anchor."""
        return f"{self.system}{SYSTEM_SEPARATOR}{self.anchor}" if self.system else self.anchor

    def record(self) -> dict:
        """The task as a store's metadata keeps it (a task without a system prompt as before there was one)."""
        record = asdict(self)
        if not self.system:
            del record["system"]
        return record

    @property
    def query_prefix(self) -> str:
        """The template up to the output, e.g. ``"Query: {input}\\nIntent:"``."""
        return self.template[: self.template.index("{output}")].rstrip(" ")

    def render(self, demo: Demonstration) -> str:
        """The demonstration written out with the template."""
        return _fill(self.template, {"input": demo.input, "output": demo.output})

    def render_query(self, text: str) -> str:
        """A query written like a demonstration whose output the model is to continue."""
        return _fill(self.query_prefix, {"input": text})

    def answer_of(self, text: str) -> str | None:
        """The answer a demonstration output or a generation states, in canonical form.

        For labels: the first line, stripped. For numbers: `milo_infer.tasks.scoring.extract_number`'s
        reading (the number after the last "answer is", else the last number), written without
        thousands separators or a trailing ".0"; None if there is none.
        """
        if self.answer_kind == "label":
            return text.strip().split("\n", 1)[0].strip()
        value = extract_number(text)
        return None if value is None else canonical_number(value)


def _fill(template: str, values: dict[str, str]) -> str:
    # One pass, so a "{output}" inside the input text stays text.
    return _FIELD.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def canonical_number(value: float) -> str:
    """A number as demonstrations and answers write it: no trailing ".0" on an integer."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


# --- user corpora --------------------------------------------------------------------------------

def load_corpus(path: str | os.PathLike) -> list[Demonstration]:
    """Read demonstrations from a ``.jsonl`` or ``.csv`` file with ``input`` and ``output`` fields.

    ``id`` is optional (a string or an integer); missing ids default to the 1-based row number.
    Other fields are ignored. Blank JSONL lines are not rows. Any bad row raises `CorpusError` with
    the file and line: rows are never dropped silently.
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such corpus file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise CorpusError(f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x}); save the file as UTF-8") from None
    if not text.strip():
        raise CorpusError(f"{path}: the corpus is empty (no rows)")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path, text)
    elif suffix == ".csv":
        rows = _csv_rows(path, text)
    else:
        raise CorpusError(f"{path}: unknown corpus format {suffix!r}; use .jsonl or .csv")
    demos, seen = [], {}
    for number, (line, row) in enumerate(rows, start=1):
        demo = _demonstration(path, line, row, default_id=str(number))
        if demo.id in seen:
            raise CorpusError(f"{path}:{line}: duplicate id {demo.id!r} (first on line {seen[demo.id]})")
        seen[demo.id] = line
        demos.append(demo)
    if not demos:
        raise CorpusError(f"{path}: the corpus is empty (no rows)")
    return demos


def _jsonl_rows(path: Path, text: str):
    for line, content in enumerate(text.splitlines(), start=1):
        if not content.strip():
            continue
        try:
            row = json.loads(content)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}:{line}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise CorpusError(f"{path}:{line}: expected a JSON object with input and output, got {type(row).__name__}")
        yield line, row


def _csv_rows(path: Path, text: str):
    reader = csv.DictReader(io.StringIO(text, newline=""))
    header = reader.fieldnames or []
    missing = [name for name in ("input", "output") if name not in header]
    if missing:
        raise CorpusError(f"{path}:1: the CSV header {header} lacks column(s) {', '.join(missing)}")
    for row in reader:
        if None in row:
            raise CorpusError(f"{path}:{reader.line_num}: more fields than the header's {len(header)}")
        yield reader.line_num, {key: value for key, value in row.items() if value is not None}


def _demonstration(path: Path, line: int, row: dict, default_id: str) -> Demonstration:
    values = {}
    for name in ("input", "output"):
        if name not in row:
            raise CorpusError(f"{path}:{line}: missing field {name!r}")
        value = row[name]
        if not isinstance(value, str):
            raise CorpusError(f"{path}:{line}: field {name!r} must be a string, got {type(value).__name__} {value!r}")
        if not value.strip():
            raise CorpusError(f"{path}:{line}: field {name!r} is empty")
        values[name] = value
    ident = row.get("id")
    if ident is None or ident == "":
        ident = default_id
    elif isinstance(ident, bool) or not isinstance(ident, (str, int)):
        raise CorpusError(f"{path}:{line}: field 'id' must be a string or an integer, got {type(ident).__name__}")
    return Demonstration(input=values["input"], output=values["output"], id=str(ident))


def task_from_corpus(demos: list[Demonstration], template: str | None = None, anchor: str | None = None,
                     name: str = "custom") -> TaskSpec:
    """A `TaskSpec` for a user's corpus: numbers if every output states one, else labels.

    Labels are the distinct outputs, in order of first appearance. The default anchor lists them
    when there are at most `MAX_LABELS_IN_ANCHOR`.
    """
    if not demos:
        raise ValueError("task_from_corpus needs at least one demonstration")
    numeric = all(_NUMERIC_OUTPUT.fullmatch(d.output) and extract_number(d.output) is not None for d in demos)
    if numeric:
        return TaskSpec(name, template or GENERIC_TEMPLATE, anchor if anchor is not None else "", "number")
    labels = tuple(dict.fromkeys(d.output.strip() for d in demos))
    if anchor is None:
        anchor = label_anchor("Give the label of each input", labels)
    return TaskSpec(name, template or GENERIC_TEMPLATE, anchor, "label", labels)


def label_anchor(instruction: str, labels: tuple[str, ...]) -> str:
    """The instruction, naming the labels when there are at most `MAX_LABELS_IN_ANCHOR`."""
    if len(labels) <= MAX_LABELS_IN_ANCHOR:
        return f"{instruction}, one of: {', '.join(labels)}.\n\n"
    return f"{instruction}.\n\n"
