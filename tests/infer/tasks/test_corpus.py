"""Corpus loading, task rendering, and the benchmark loaders on the shared data."""
import json
import logging
from pathlib import Path

import pytest

import milo_infer
from milo_infer.tasks.corpus import SHIPPED_DATA, CorpusError, Demonstration, TaskSpec, load_corpus, task_from_corpus
from milo_infer.tasks.datasets import DATASETS, SVAMP_TEST_SIZE, DatasetUnavailable, data_root, load_dataset

DATA = SHIPPED_DATA


def dataset(name, **kwargs):
    try:
        return load_dataset(name, **kwargs)
    except DatasetUnavailable as exc:
        pytest.skip(f"shared data unavailable: {exc}")


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


# --- user corpora ------------------------------------------------------------------------------

def test_jsonl_and_csv_give_the_same_demonstrations(tmp_path):
    jsonl = write(tmp_path / "c.jsonl", '{"input": "hi", "output": "greet", "id": "a"}\n\n{"input": "bye", "output": "leave"}\n')
    table = write(tmp_path / "c.csv", 'input,output,id\nhi,greet,a\n"bye, now",leave,\n')
    assert load_corpus(jsonl) == [Demonstration("hi", "greet", "a"), Demonstration("bye", "leave", "2")]
    assert load_corpus(table) == [Demonstration("hi", "greet", "a"), Demonstration("bye, now", "leave", "2")]


def test_integer_ids_and_extra_fields_and_bom(tmp_path):
    path = write(tmp_path / "c.jsonl", b'\xef\xbb\xbf{"input": "x", "output": "y", "id": 7, "note": "ignored"}\n')
    assert load_corpus(path) == [Demonstration("x", "y", "7")]


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", "\n \n", "empty.jsonl: the corpus is empty"),
    ("empty.csv", "input,output\n", "empty.csv: the corpus is empty"),
    ("missing.jsonl", '{"input": "a", "output": "b"}\n{"input": "c"}\n', "missing.jsonl:2: missing field 'output'"),
    ("missing.csv", "input,output\na,b\nc\n", "missing.csv:3: missing field 'output'"),
    ("header.csv", "text,label\na,b\n", "lacks column(s) input, output"),
    ("wide.csv", "input,output\na,b,c\n", "wide.csv:2: more fields than the header's 2"),
    ("number.jsonl", '{"input": "a", "output": 3}\n', "number.jsonl:1: field 'output' must be a string, got int 3"),
    ("null.jsonl", '{"input": null, "output": "b"}\n', "field 'input' must be a string, got NoneType"),
    ("blank.jsonl", '{"input": "  ", "output": "b"}\n', "blank.jsonl:1: field 'input' is empty"),
    ("badid.jsonl", '{"input": "a", "output": "b", "id": [1]}\n', "field 'id' must be a string or an integer"),
    ("dup.jsonl", '{"input": "a", "output": "b", "id": "x"}\n{"input": "c", "output": "d", "id": "x"}\n',
     "dup.jsonl:2: duplicate id 'x' (first on line 1)"),
    ("broken.jsonl", '{"input": "a", "output": "b"}\n{"input": \n', "broken.jsonl:2: not valid JSON"),
    ("list.jsonl", '["a", "b"]\n', "list.jsonl:1: expected a JSON object"),
    ("latin.csv", "input,output\nok,fine\ncaf\xe9,drink\n".encode("latin-1"), "latin.csv:3: not UTF-8 text"),
    ("corpus.txt", "input,output\n", "unknown corpus format '.txt'"),
])
def test_bad_corpora_are_refused_with_file_and_line(tmp_path, name, content, message):
    path = write(tmp_path / name, content)
    with pytest.raises(CorpusError) as info:
        load_corpus(path)
    assert message in str(info.value)


def test_missing_corpus_file(tmp_path):
    with pytest.raises(CorpusError, match="nope.jsonl: no such corpus file"):
        load_corpus(tmp_path / "nope.jsonl")


# --- task specs --------------------------------------------------------------------------------

def test_task_renders_demonstrations_and_queries():
    task = TaskSpec("t", "Query: {input}\nIntent: {output}\n\n", "Classify.\n\n", "label", ("a", "b"))
    assert task.query_prefix == "Query: {input}\nIntent:"
    assert task.render(Demonstration("lost {output} card", "a", "1")) == "Query: lost {output} card\nIntent: a\n\n"
    assert task.render_query("where is it?") == "Query: where is it?\nIntent:"
    assert task.answer_of(" b\nQuery: next") == "b"


@pytest.mark.parametrize("template", ["{output} {input}", "Q: {input}", "{input}{output}{input}"])
def test_bad_templates_are_refused(template):
    with pytest.raises(ValueError, match="must contain {input} then {output}"):
        TaskSpec("t", template, "", "number")


def test_label_task_needs_labels_and_known_kind():
    with pytest.raises(ValueError, match="needs its list of labels"):
        TaskSpec("t", "{input} {output}", "", "label")
    with pytest.raises(ValueError, match="answer_kind must be"):
        TaskSpec("t", "{input} {output}", "", "text")


@pytest.mark.parametrize("text, answer", [
    ("3 + 4 = 7.\nThe answer is 7.", "7"), ("so the answer is $1,250.", "1250"),
    ("The answer is 2.50", "2.5"), ("The answer is -3. Then 9 more", "-3"), ("it makes 12 apples", "12"),
    ("no number here", None),
])
def test_number_answers(text, answer):
    assert TaskSpec("m", "{input} {output}", "", "number").answer_of(text) == answer


def test_task_from_corpus_infers_labels_or_numbers():
    labels = [Demonstration("a", "x", "1"), Demonstration("b", "y", "2"), Demonstration("c", "x", "3")]
    task = task_from_corpus(labels, anchor="Label it.\n\n")
    assert (task.answer_kind, task.labels, task.anchor) == ("label", ("x", "y"), "Label it.\n\n")
    assert task.template == "Input: {input}\nOutput: {output}\n\n"
    assert "one of: x, y." in task_from_corpus(labels).anchor
    numbers = [Demonstration("1+1", "2", "1"), Demonstration("2*3", "2*3 = 6. The answer is 6.", "2")]
    assert task_from_corpus(numbers, template="Q: {input}\nA: {output}\n").answer_kind == "number"
    with pytest.raises(ValueError):
        task_from_corpus([])


# --- the shipped demo corpus -------------------------------------------------------------------

def test_demo_corpus_loads():
    demos = load_corpus(DATA / "demo_corpus.jsonl")
    queries = load_corpus(DATA / "demo_queries.jsonl")
    task = task_from_corpus(demos)
    assert len(demos) == 240 and len(task.labels) == 12 and task.answer_kind == "label"
    assert all(sum(d.output == label for d in demos) == 20 for label in task.labels)
    assert {q.output for q in queries} == set(task.labels)
    assert not {q.input.lower() for q in queries} & {d.input.lower() for d in demos}


# --- benchmark data sets -----------------------------------------------------------------------

SIZES = {"banking77": (10003, 3080, 77), "clinc150": (15000, 4500, 150), "trec": (5443, 499, 6),
         "trec-fine": (5443, 499, 50), "svamp": (1000 - SVAMP_TEST_SIZE, SVAMP_TEST_SIZE, 0),
         "gsm8k": (7473, 1319, 0)}


@pytest.mark.slow
@pytest.mark.parametrize("name", DATASETS)
def test_dataset_sizes_splits_and_labels(name):
    train, test, task = dataset(name)
    assert (len(train), len(test), len(task.labels)) == SIZES[name]
    assert task.name == name
    assert not {d.id for d in train} & {d.id for d in test}
    assert len({d.id for d in train + test}) == len(train) + len(test)
    for demo in train[:50] + test[:50]:
        assert demo.input.strip() and "_" not in demo.output
        assert task.render(demo).startswith(task.render_query(demo.input))
        if task.answer_kind == "label":
            assert demo.output in task.labels
        else:
            assert demo.output.endswith(f"The answer is {task.answer_of(demo.output)}.")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["banking77", "svamp"])
def test_splits_are_seeded(name):
    first, again, other = dataset(name, seed=0), dataset(name, seed=0), dataset(name, seed=1)
    assert first[0] == again[0] and first[1] == again[1]
    assert first[0] != other[0]
    assert sorted(d.id for d in first[0]) == sorted(d.id for d in other[0])  # the seed orders, the split stays
    assert sorted(d.id for d in first[1]) == sorted(d.id for d in other[1])


@pytest.mark.slow
def test_readable_labels():
    assert "refund not showing up" in dataset("banking77")[2].labels
    assert "are you a bot" in dataset("clinc150")[2].labels
    assert dataset("trec")[2].labels == ("abbreviation", "description", "entity", "human", "location", "number")
    fine = dataset("trec-fine")[2].labels
    assert len(set(fine)) == 50 and {"date", "individual", "other location", "person description"} <= set(fine)


@pytest.mark.slow
def test_trec_malformed_line_is_skipped_and_counted(caplog):
    with caplog.at_level(logging.WARNING, logger="milo_infer.tasks.datasets"):
        train, _, _ = dataset("trec")
    assert "skipped 1 malformed line(s)" in caplog.text and "[4451]" in caplog.text
    assert "train-4451" not in {d.id for d in train}


@pytest.mark.slow
def test_math_outputs():
    train, _, task = dataset("gsm8k")
    first = next(d for d in train if d.input.startswith("Natalia sold clips"))
    assert first.output == ("Natalia sold 48/2 = 24 clips in May.\n"
                            "Natalia sold 48+24 = 72 clips altogether in April and May.\nThe answer is 72.")
    train, test, task = dataset("svamp")
    chal1 = next(d for d in train + test if d.id == "chal-1")
    assert chal1.output == "76 - 25 = 51. The answer is 51." and task.answer_of(chal1.output) == "51"


def test_missing_data_is_unavailable(tmp_path, monkeypatch):
    with pytest.raises(DatasetUnavailable, match="does not exist"):
        load_dataset("trec", data_dir=tmp_path / "nowhere")
    with pytest.raises(DatasetUnavailable, match="missing data file .*train_5500.label"):
        load_dataset("trec", data_dir=tmp_path)
    monkeypatch.setenv("MILO_DATA", str(tmp_path))
    assert data_root() == tmp_path
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        load_dataset("mnist")


def test_default_data_root_is_beside_the_repository(monkeypatch):
    monkeypatch.delenv("MILO_DATA", raising=False)
    assert data_root() == Path(milo_infer.__file__).resolve().parents[1].parent / "shared" / "data"


def test_loaders_on_a_small_copy(tmp_path):
    """The loaders need only the documented files: a tiny hand-made copy works without shared/."""
    trec = tmp_path / "trec"
    trec.mkdir()
    write(trec / "train_5500.label", "NUM:date When was it ?\nNUM:How count many ?\nHUM:ind Who is it ?\n")
    write(trec / "TREC_10.en.label", "LOC:city Which city ?\n")
    train, test, task = load_dataset("trec-fine", data_dir=tmp_path)
    assert sorted(d.output for d in train) == ["date", "individual"] and test[0].output == "city"
    rows = [{"question": "Two plus 1,000?", "answer": "2 + 1000 = <<2+1000=1002>>1002\n#### 1,002"}]
    gsm = tmp_path / "gsm8k" / "grade_school_math" / "data"
    gsm.mkdir(parents=True)
    for split in ("train", "test"):
        write(gsm / f"{split}.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    train, _, task = load_dataset("gsm8k", data_dir=tmp_path)
    assert train[0].output == "2 + 1000 = 1002\nThe answer is 1002."


def test_free_text_outputs_are_labels_not_numbers():
    demos = [Demonstration("a", "room 12", "1"), Demonstration("b", "7", "2")]
    assert task_from_corpus(demos).answer_kind == "label"
    assert task_from_corpus([Demonstration("a", "#### 1,000", "1")]).answer_kind == "number"
