"""Data formats and sources (issue 25, item 3), on real files: Parquet written by pyarrow,
`datasets` save_to_disk folders (a Dataset and a DatasetDict), a ConfigMap mount holding
Parquet bytes, the real S3 server holding a Parquet object and a whole datasets folder;
and the ways a row becomes a prompt (messages, a template, a system prompt, columns)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncgrpo.api import RunValidationError, parse_run
from asyncgrpo.storage import Bucket
from asyncgrpo.storage import client as s3_client
from asyncgrpo.trainer.data import (
    DataError,
    apply_chat_template,
    load_dataset,
    load_eval_rows,
    load_rows,
)

GSM8K = [  # the shape of openai/gsm8k: question, answer with the reasoning and '#### N'
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "In May she sold 48/2 = 24 clips.\nIn all 48+24 = 72.\n#### 72"},
    {"question": "Weng earns $12 an hour. How much for 50 minutes?",
     "answer": "12/60 = 0.2 per minute.\n0.2 x 50 = 10.\n#### 10"},
    {"question": "A book costs $1,200. How much for two?", "answer": "2 x 1200\n#### 2,400"},
]

MATH = {"promptTemplate": "{question}\nEnd with '#### <number>'.",
        "systemPrompt": "You are a careful math tutor.",
        "columns": {"answer": {"field": "answer", "pattern": r"####\s*(.+)$"},
                    "reasoning": {"field": "answer"}}}


def run_with(data: dict, **model) -> object:
    return parse_run({
        "metadata": {"name": "data-run"},
        "spec": {"model": {"name": "m", **model}, "adapterStore": {"bucket": "bkt"},
                 "data": data,
                 "trainer": {"totalSteps": 2, "promptsPerStep": 2, "maxStaleness": 0},
                 "reward": {"functions": [{"name": "numeric_match"}]}},
    })


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def check_gsm8k(rows):
    assert rows[0]["prompt"] == [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": GSM8K[0]["question"] + "\nEnd with '#### <number>'."}]
    assert [r["answer"] for r in rows] == ["72", "10", "2,400"]
    assert rows[1]["reasoning"] == GSM8K[1]["answer"]  # a copy, full text
    assert rows[0]["question"] == GSM8K[0]["question"]  # other columns ride along


def test_parquet_file_with_the_question_answer_mapping(tmp_path):
    p = write_parquet(tmp_path / "train.parquet", GSM8K)
    check_gsm8k(load_rows(run_with({"path": str(p), **MATH})))
    ds = load_dataset(run_with({"path": str(p), "shuffle": False, **MATH}))
    assert ds[3]["answer"] == "72" and len(ds) % 3 == 0  # passes over the file, in order


def test_the_first_rows_of_parquet_span_row_groups(tmp_path):
    from asyncgrpo.trainer.data import read_rows

    pq.write_table(pa.Table.from_pylist([{"prompt": f"p{i}"} for i in range(10)]),
                   tmp_path / "groups.parquet", row_group_size=3)
    spec = run_with({"path": str(tmp_path / "groups.parquet")}).spec.data
    rows, _ = read_rows(spec, limit=7)
    assert [r["prompt"] for _, r in rows] == [f"p{i}" for i in range(7)]


def test_a_parquet_file_under_another_name_needs_format(tmp_path):
    p = write_parquet(tmp_path / "train.bin", GSM8K)
    with pytest.raises(DataError, match=r"not UTF-8 .* format: parquet"):
        load_rows(run_with({"path": str(p), **MATH}))
    check_gsm8k(load_rows(run_with({"path": str(p), "format": "parquet", **MATH})))
    (tmp_path / "bad.parquet").write_text('{"prompt": "x"}\n')
    with pytest.raises(DataError, match="bad.parquet: not a Parquet file"):
        load_rows(run_with({"path": str(tmp_path / "bad.parquet")}))


def test_datasets_folders_a_dataset_and_a_dataset_dict_with_an_eval_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(GSM8K).save_to_disk(str(tmp_path / "one"))
    check_gsm8k(load_rows(run_with({"path": str(tmp_path / "one"), **MATH})))

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K),
                               "test": datasets.Dataset.from_list(GSM8K[::-1])})
    dd.save_to_disk(str(tmp_path / "dict"))
    run = run_with({"path": str(tmp_path / "dict"), **MATH,
                    "eval": {"split": "test", "maxRows": 2, "evalSteps": 3}})
    check_gsm8k(load_rows(run))  # train by default
    evals = load_eval_rows(run)
    assert [r["answer"] for r in evals] == ["2,400", "10"]  # the test split, first maxRows
    assert evals[0]["prompt"][0]["role"] == "system"  # read like the training rows

    with pytest.raises(DataError, match=r"no split 'dev' \(splits: train, test\)") as e:
        load_rows(run_with({"path": str(tmp_path / "dict"), "split": "dev", **MATH}))
    assert e.value.field == "split"
    with pytest.raises(DataError, match="holds one Dataset, not a DatasetDict"):
        load_rows(run_with({"path": str(tmp_path / "one"), "split": "test", **MATH}))
    with pytest.raises(DataError, match="not a datasets save_to_disk folder"):
        load_rows(run_with({"path": str(tmp_path), **MATH}))


def test_a_configmap_key_holding_parquet_and_an_eval_key(tmp_path):
    write_parquet(tmp_path / "train.parquet", GSM8K)
    (tmp_path / "eval").mkdir()  # where the projected volume puts the eval ConfigMap's key
    (tmp_path / "eval" / "held-out.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in GSM8K[:1]))
    run = run_with({"configMap": {"name": "gsm8k", "key": "train.parquet"}, **MATH,
                    "eval": {"configMap": {"name": "gsm8k-eval", "key": "held-out.jsonl"}}})
    env = {"ASYNCGRPO_DATA_DIR": str(tmp_path)}
    check_gsm8k(load_rows(run, env=env))
    assert [r["answer"] for r in load_eval_rows(run, env=env)] == ["72"]


def test_the_bucket_holds_a_parquet_object_and_a_datasets_folder(s3_server, monkeypatch,
                                                                 tmp_path):
    import datasets

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    c = s3_server.client()
    c.create_bucket(Bucket="formats")
    c.put_object(Bucket="formats", Key="sets/gsm8k.parquet",
                 Body=write_parquet(tmp_path / "g.parquet", GSM8K).read_bytes())
    folder = tmp_path / "folder"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K),
                          "test": datasets.Dataset.from_list(GSM8K[1:])}).save_to_disk(
        str(folder))
    for f in folder.rglob("*"):
        if f.is_file():
            c.put_object(Bucket="formats", Key=f"sets/gsm8k-dd/{f.relative_to(folder)}",
                         Body=f.read_bytes())
    bucket = Bucket("formats", "", s3_client(s3_server.endpoint, "us-east-1"))
    check_gsm8k(load_rows(run_with({"bucketPath": "sets/gsm8k.parquet", **MATH}), bucket))
    run = run_with({"bucketPath": "sets/gsm8k-dd", **MATH, "eval": {"split": "test"}})
    check_gsm8k(load_rows(run, bucket, workdir=tmp_path))
    assert [r["answer"] for r in load_eval_rows(run, bucket, workdir=tmp_path)] == ["10", "2,400"]
    with pytest.raises(DataError, match=r"s3://formats/sets/nothing: no such object or folder"):
        load_rows(run_with({"bucketPath": "sets/nothing", **MATH}), bucket, workdir=tmp_path)


def test_chat_messages_rows_give_the_prompt_and_the_answer(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
         "answer": None},  # a column the first row lacks is a null in Parquet
        {"messages": [{"role": "system", "content": "Terse."}, {"role": "user", "content": "3+3?"}],
         "answer": "6"},
    ]
    p = write_parquet(tmp_path / "chat.parquet", rows)
    out = load_rows(run_with({"path": str(p), "messagesField": "messages",
                              "systemPrompt": "Think step by step."}))
    assert out[0]["prompt"] == [{"role": "system", "content": "Think step by step."},
                                {"role": "user", "content": "2+2?"}]
    assert out[0]["answer"] == "4"  # the trailing assistant turn, cut off the prompt
    assert out[1]["prompt"][0] == {"role": "system", "content": "Terse."}  # the row's own wins
    assert out[1]["answer"] == "6" and "messages" not in out[1]

    only = tmp_path / "only.jsonl"
    only.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"only.jsonl:1: 'messages' has only assistant turns"):
        load_rows(run_with({"path": str(only), "messagesField": "messages"}))


def test_template_and_column_errors_name_the_row_and_the_field(tmp_path):
    p = tmp_path / "qa.jsonl"
    p.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n"
                 + json.dumps({"query": "q2", "answer": "#### 2"}) + "\n")
    with pytest.raises(DataError, match=r"qa.jsonl:2: promptTemplate names \{question\}") as e:
        load_rows(run_with({"path": str(p), "promptTemplate": "{question}"}))
    assert e.value.field == "promptTemplate"
    with pytest.raises(DataError, match=r"qa.jsonl:1: columns.gold reads 'solution'") as e:
        load_rows(run_with({"path": str(p), "promptTemplate": "{answer}",
                            "columns": {"gold": {"field": "solution"}}}))
    assert e.value.field == "columns.gold.field"
    with pytest.raises(DataError, match=r"qa.jsonl:1: no field 'prompt' \(columns: answer, "
                                        r"question\)"):
        load_rows(run_with({"path": str(p)}))


@pytest.mark.parametrize(("data", "model", "path", "match"), [
    ({"path": "x", "messagesField": "m", "promptTemplate": "{q}"}, {},
     "spec.data.promptTemplate", "give one of promptField, messagesField, promptTemplate"),
    ({"path": "x", "promptTemplate": "{q"}, {}, "spec.data.promptTemplate",
     "not a valid template"),
    ({"path": "x", "promptTemplate": "no columns"}, {}, "spec.data.promptTemplate",
     "names no {column}"),
    ({"path": "x", "columns": {"a": {"field": "b", "pattern": "(["}}}, {},
     "spec.data.columns.a.pattern", "not a valid regular expression"),
    ({"path": "x", "eval": {"maxRows": 4}}, {}, "spec.data.eval",
     "give a source (bucketPath, configMap, path) or the split"),
    ({"path": "x", "eval": {"path": "y", "bucketPath": "z"}}, {}, "spec.data.eval",
     "give exactly one of"),
    ({"configMap": {"name": "c", "key": "k"}, "format": "datasets"}, {}, "spec.data.format",
     "a ConfigMap key is one file"),
    ({"path": "x"}, {"chatTemplate": "{{ x }}", "chatTemplatePath": "t.jinja"},
     "spec.model.chatTemplatePath", "give one of chatTemplate, chatTemplatePath"),
])
def test_the_run_file_refuses_contradictions_naming_the_field(data, model, path, match):
    with pytest.raises(RunValidationError) as e:
        run_with(data, **model)
    assert any(err.path == path and match in err.message for err in e.value.errors), \
        e.value.errors


def test_trl_args_cannot_set_the_eval_schedule():
    with pytest.raises(RunValidationError, match=r"trlArgs.eval_steps: set by "
                                                 r"spec.data.eval.evalSteps"):
        parse_run({"metadata": {"name": "r"}, "spec": {
            "model": {"name": "m"}, "adapterStore": {"bucket": "bkt"}, "data": {"path": "x"},
            "trainer": {"trlArgs": {"eval_steps": 5}},
            "reward": {"functions": [{"name": "numeric_match"}]}}})


def test_a_chat_template_of_the_run_replaces_the_tokenizer_s(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0},
                                                                             "[UNK]")))
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
    apply_chat_template(tok, run_with({"path": "x"}, chatTemplatePath=str(tmpl)).spec.model)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<user>hi<assistant>"
    with pytest.raises(DataError, match="no such file") as e:
        apply_chat_template(tok, run_with({"path": "x"}, chatTemplatePath=str(tmp_path / "n"))
                            .spec.model)
    assert e.value.field == "chatTemplatePath"


def test_the_gsm8k_recipe_of_the_guide_reads_gsm8k_rows(tmp_path):
    """docs/tasks.md's run fragment, as written, on a real DatasetDict of GSM8K's shape."""
    import re

    import datasets
    import yaml

    from asyncgrpo.trainer.rewards import build_rewards
    from tests.api.invalid_specs import REPO

    doc = (REPO / "docs" / "tasks.md").read_text()
    section = doc[doc.index("### Question/answer data"):]
    spec = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1))["spec"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K),
                          "test": datasets.Dataset.from_list(GSM8K[:2])}).save_to_disk(
        str(tmp_path / "gsm8k"))
    spec["data"]["path"] = str(tmp_path / "gsm8k")
    run = parse_run({"metadata": {"name": "gsm8k"}, "spec": {
        "model": {"name": "m"}, "adapterStore": {"bucket": "bkt"}, **spec}})
    rows = load_rows(run)
    assert [r["answer"] for r in rows] == ["72", "10", "2,400"]
    assert rows[0]["prompt"][0]["role"] == "system"
    assert [r["answer"] for r in load_eval_rows(run)] == ["72", "10"]
    (term,) = build_rewards(run.spec.reward)
    said = [[{"role": "assistant", "content": "48+24 = 72\n#### 72"}],
            [{"role": "assistant", "content": "#### 12"}],
            [{"role": "assistant", "content": "so #### 2,400"}]]
    assert term(said, answer=[r["answer"] for r in rows]) == [1.0, 0.0, 1.0]


def test_the_eval_reward_reaches_its_gauges():
    from asyncgrpo.trainer.evaluation import summarize
    from asyncgrpo.trainer.metrics import TrainerMetrics

    nan = float("nan")
    s = summarize([{"reward": 1.0, "rewards/f": 1.0}, {"reward": 0.0, "rewards/f": 0.0},
                   {"reward": nan, "rewards/f": nan}])
    assert s["reward"] == 0.5 and s["reward_std"] == 0.5 and s["rewards/f"] == 0.5
    assert s["scored_ratio"] == 2 / 3 and s["rollouts"] == 3.0
    m = TrainerMetrics()
    m.update_from_logs({f"eval_{k}": v for k, v in s.items()})
    text = m.exposition().decode()
    assert "asyncgrpo_trainer_eval_reward_mean 0.5" in text
    assert "asyncgrpo_trainer_eval_reward_std 0.5" in text
