"""Prompt data: JSON Lines, Parquet or a `datasets` folder, from the image, a volume, a
ConfigMap or the bucket; made into TRL's rows.

Reading (`read_rows`) and making a row (`prepare_rows`) are apart so the preflight parses
the first rows exactly as the trainer will. A row becomes TRL's shape, `{"prompt": [chat
messages], <every other column>}`: the prompt from `promptField` (a string is one user
message, a list is chat messages), `messagesField` (a conversation whose trailing assistant
turns are cut off; the last one becomes `answer` when the row has none) or `promptTemplate`
(a user message made from the row's columns); `systemPrompt` goes first unless the row has
a system message; `columns` adds reward columns (a copy, or what a regex finds: GSM8K's
`#### 72`). Every other column rides along to the reward functions and the environment's
`reset(**row)`. A malformed row is an error naming its row (line) number: a silently dropped
prompt would shift the data position a resumed run restores.

Order: with `shuffle`, the rollout worker sees epoch after epoch, each a permutation seeded
by (seed, epoch); without it, the file order repeated. The order is a pure function of the
data and the seed, so the checkpoint's data position (an index into this order, kept by
TRL as `prompt_index`) means the same prompt after a restart.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from string import Formatter
from typing import Any

from asyncgrpo.wire import DATA_DIR, DATA_DIR_ENV

#: bytes read from the start of a JSON Lines file when only its first rows are wanted
HEAD_BYTES = 1 << 20
#: where an eval ConfigMap key is mounted, under the data folder (one projected volume)
EVAL_SUBDIR = "eval"


class DataError(ValueError):
    """The data set cannot be used as given; the message says where."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field  # the spec field to change, when it is not the source itself


# ---------------------------------------------------------------- formats


def data_format(spec, name: str, is_dir: bool) -> str:
    """The format of a source: spec.format, or from the name (auto)."""
    if spec.format != "auto":
        return spec.format
    if is_dir or name.endswith("/"):
        return "datasets"
    if name.lower().endswith((".parquet", ".pq")):
        return "parquet"
    return "jsonl"


def parse_jsonl_objects(text: str, source: str = "data",
                        limit: int | None = None) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line."""
    out: list[tuple[int, dict[str, Any]]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{source}:{n}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{source}:{n}: expected a JSON object, got {type(obj).__name__}")
        out.append((n, obj))
        if limit is not None and len(out) >= limit:
            break
    return out


def read_parquet(data: bytes | str | Path, source: str,
                 limit: int | None = None) -> list[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(io.BytesIO(data) if isinstance(data, bytes) else str(data))
        if limit is None:
            rows = f.read().to_pylist()
        else:
            rows = []  # batches stop at row-group ends: gather until there are enough
            for batch in f.iter_batches(batch_size=limit):
                rows.extend(batch.to_pylist())
                if len(rows) >= limit:
                    break
            rows = rows[:limit]
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{source}: not a Parquet file ({type(e).__name__}: {e})") from None
    return list(enumerate(rows, start=1))


def read_datasets_folder(path: Path, split: str | None, source: str,
                         limit: int | None = None) -> list[tuple[int, dict[str, Any]]]:
    """Rows of a `datasets` save_to_disk folder: a Dataset, or one split of a DatasetDict."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - FileNotFoundError, a bad state.json...
        raise DataError(f"{source}: not a datasets save_to_disk folder "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    if isinstance(ds, datasets.DatasetDict):
        name = split or "train"
        if name not in ds:
            raise DataError(f"{source}: no split {name!r} (splits: {', '.join(ds)})", "split")
        ds = ds[name]
    elif split is not None:
        raise DataError(f"{source}: split {split!r} given, but the folder holds one Dataset, "
                        "not a DatasetDict", "split")
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return list(enumerate(ds.to_list(), start=1))


def _check_split(spec, fmt: str, source: str) -> None:
    if spec.split is not None and fmt != "datasets":
        raise DataError(f"{source}: split {spec.split!r} is only read for a datasets folder "
                        f"(this source is {fmt})", "split")


# ---------------------------------------------------------------- sources


def _bucket_folder(bucket, prefix: str, dest: Path) -> Path:
    """Download every object under `prefix/` (a datasets folder) into `dest`."""
    keys = bucket.list(prefix.rstrip("/") + "/")
    if not keys:
        raise DataError(f"{bucket.url(prefix)}: no such object or folder")
    for key in keys:
        rel = key[len(prefix.rstrip("/")) + 1:]
        if rel and not rel.endswith("/"):
            bucket.download(key, dest / rel)
    return dest


def read_rows(spec, bucket=None, env: dict[str, str] | None = None, *, eval_set: bool = False,
              limit: int | None = None, workdir: Path | None = None
              ) -> tuple[list[tuple[int, dict[str, Any]]], str]:
    """((row number, raw row), source name) of a data source (`spec.data` or
    `spec.data.eval`); the first `limit` rows only when given."""
    env = os.environ if env is None else env
    if spec.path:
        p = Path(spec.path).expanduser()
        if not p.exists():
            raise DataError(f"{spec.path}: no such file or folder here (relative paths "
                            f"resolve from {Path.cwd()})")
        fmt = data_format(spec, spec.path, p.is_dir())
        _check_split(spec, fmt, spec.path)
        if fmt == "datasets":
            return read_datasets_folder(p, spec.split, spec.path, limit), spec.path
        if p.is_dir():
            raise DataError(f"{spec.path} is a folder, not a {fmt} file", "format")
        if fmt == "parquet":
            return read_parquet(p, spec.path, limit), spec.path
        if limit is not None:
            with open(p, "rb") as f:
                body = _whole_lines(f.read(HEAD_BYTES), HEAD_BYTES)
        else:
            body = p.read_bytes()
        return parse_jsonl_objects(_text(body, spec.path), spec.path, limit), spec.path
    if spec.config_map is not None:
        cm = spec.config_map
        base = Path(env.get(DATA_DIR_ENV) or DATA_DIR)
        p = (base / EVAL_SUBDIR if eval_set else base) / cm.key
        source = f"configmap:{cm.name}/{cm.key}"
        if not p.is_file():
            raise DataError(f"{source} is not mounted at {p}")
        fmt = data_format(spec, cm.key, False)
        _check_split(spec, fmt, source)
        if fmt == "parquet":
            return read_parquet(p.read_bytes(), source, limit), source
        return parse_jsonl_objects(_text(p.read_bytes(), source), source, limit), source
    if spec.bucket_path:
        if bucket is None:
            raise DataError("bucketPath needs the adapter store's bucket")
        key = spec.bucket_path.lstrip("/")
        source = bucket.url(key)
        is_object = not key.endswith("/") and bucket.exists(key)
        fmt = data_format(spec, key, not is_object)
        _check_split(spec, fmt, source)
        if fmt == "datasets":
            dest = Path(tempfile.mkdtemp(prefix="data-", dir=workdir))
            return read_datasets_folder(_bucket_folder(bucket, key, dest), spec.split, source,
                                        limit), source
        if not is_object:
            raise DataError(f"{source}: no such object")
        if limit is not None and fmt == "jsonl":
            body = _whole_lines(bucket.get_bytes(key, max_bytes=HEAD_BYTES), HEAD_BYTES)
        else:
            body = bucket.get_bytes(key)
        if fmt == "parquet":
            return read_parquet(body, source, limit), source
        return parse_jsonl_objects(_text(body, source), source, limit), source
    raise DataError("give one of path, configMap, bucketPath")


def _whole_lines(head: bytes, asked: int) -> bytes:
    """The first `asked` bytes of a file without a line cut at the end."""
    if len(head) == asked and not head.endswith(b"\n"):
        head = head[:head.rfind(b"\n") + 1]
    return head


def _text(body: bytes, source: str) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{source}: not UTF-8 text at byte {e.start} (a Parquet file? "
                        "name it *.parquet or set format: parquet)") from None


# ---------------------------------------------------------------- rows


def _messages(value: Any) -> list[dict[str, Any]] | None:
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [dict(m) for m in value]
    return None


def template_fields(template: str) -> list[str]:
    return [f for _, f, _, _ in Formatter().parse(template) if f is not None]


def prepare_row(obj: dict[str, Any], spec, where: str) -> dict[str, Any]:
    """One raw row -> TRL's row (see the module docstring). `spec`: `spec.data`."""
    row = dict(obj)
    if spec.messages_field is not None:
        f = spec.messages_field
        if f not in row:
            raise DataError(f"{where}: no field {f!r}", "messagesField")
        msgs = _messages(row.pop(f))
        if msgs is None:
            raise DataError(f"{where}: {f!r} must be a non-empty list of {{role, content}} "
                            "messages", "messagesField")
        last_answer = None
        while msgs and msgs[-1]["role"] == "assistant":
            last_answer = msgs.pop()["content"] if last_answer is None else last_answer
        if not msgs:
            raise DataError(f"{where}: {f!r} has only assistant turns: no prompt left",
                            "messagesField")
        if last_answer is not None and row.get("answer") is None:  # Parquet: a null
            row["answer"] = last_answer
        prompt = msgs
    elif spec.prompt_template is not None:
        try:
            text = spec.prompt_template.format_map(row)
        except KeyError as e:
            raise DataError(f"{where}: promptTemplate names {{{e.args[0]}}}, not a column "
                            f"(columns: {', '.join(sorted(row))})", "promptTemplate") from None
        except (ValueError, IndexError, AttributeError) as e:
            raise DataError(f"{where}: promptTemplate: {e}", "promptTemplate") from None
        prompt = [{"role": "user", "content": text}]
    else:
        f = spec.prompt_field
        if f not in row:
            raise DataError(f"{where}: no field {f!r} (columns: {', '.join(sorted(row))})",
                            "promptField")
        value = row.pop(f)
        if isinstance(value, str):
            if not value:
                raise DataError(f"{where}: empty prompt", "promptField")
            prompt = [{"role": "user", "content": value}]
        else:
            prompt = _messages(value)
            if prompt is None:
                raise DataError(f"{where}: {f!r} must be a string or a non-empty list of "
                                "{role, content} messages", "promptField")
        if "prompt" in row and f != "prompt":
            raise DataError(f"{where}: has both {f!r} and 'prompt'", "promptField")
    if spec.system_prompt is not None and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": spec.system_prompt}, *prompt]
    for name, col in spec.columns.items():
        if col.field not in obj:
            raise DataError(f"{where}: columns.{name} reads {col.field!r}, not a column "
                            f"(columns: {', '.join(sorted(obj))})", f"columns.{name}.field")
        value = obj[col.field]
        if col.pattern is not None:
            m = re.search(col.pattern, "" if value is None else str(value))
            value = None if m is None else (m.group(1) if m.re.groups else m.group(0)).strip()
        row[name] = value
    row.pop("prompt", None)
    return {"prompt": prompt, **row}


def prepare_rows(rows: Iterable[tuple[int, dict[str, Any]]], spec, source: str
                 ) -> list[dict[str, Any]]:
    out = [prepare_row(obj, spec, f"{source}:{n}") for n, obj in rows]
    if not out:
        raise DataError(f"{source}: no prompts")
    return out


def parse_jsonl(text: str, prompt_field: str = "prompt", source: str = "data"
                ) -> list[dict[str, Any]]:
    """JSON Lines with the prompt in `prompt_field` (the original shape, kept for callers
    that have text in hand)."""
    from asyncgrpo.api import DataSpec

    spec = DataSpec(path="-", prompt_field=prompt_field)
    return prepare_rows(parse_jsonl_objects(text, source), spec, source)


# ---------------------------------------------------------------- the chat template


def read_chat_template(model) -> str | None:
    """spec.model.chatTemplate, or the text of chatTemplatePath; None: the tokenizer's."""
    if model.chat_template is not None:
        return model.chat_template
    if model.chat_template_path is None:
        return None
    p = Path(model.chat_template_path).expanduser()
    if not p.is_file():
        raise DataError(f"{model.chat_template_path}: no such file (relative paths resolve "
                        f"from {Path.cwd()})", "chatTemplatePath")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise DataError(f"{model.chat_template_path}: empty", "chatTemplatePath")
    return text


def apply_chat_template(tokenizer, model):
    """The tokenizer with the run's chat template, if it gives one (TRL's rollout worker
    renders every prompt with `tokenizer.apply_chat_template`; vLLM gets token ids)."""
    text = read_chat_template(model)
    if text is not None:
        tokenizer.chat_template = text
    return tokenizer


# ---------------------------------------------------------------- order, TRL's dataset


def epoch_order(n: int, epochs: int, seed: int, shuffle: bool) -> list[int]:
    """Row indices for `epochs` passes; each pass a (seed, epoch)-seeded permutation."""
    order: list[int] = []
    for epoch in range(epochs):
        idx = list(range(n))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(idx)
        order.extend(idx)
    return order


def epochs_needed(n_prompts: int, total_steps: int, prompts_per_step: int, max_staleness: int) -> int:
    """Passes that cover the prompts a run can draw: each step consumes `prompts_per_step`
    groups and generation runs at most `max_staleness + 1` steps ahead; one spare pass."""
    draws = (total_steps + max_staleness + 2) * prompts_per_step
    return max(1, math.ceil(draws / n_prompts)) + 1


def eval_source(data):
    """The source of the eval rows: spec.data.eval, or (no source of its own) the training
    source with the eval's split."""
    e = data.eval
    if any(getattr(e, k) is not None for k in ("bucket_path", "config_map", "path")):
        return e, True
    return data.model_copy(update={"split": e.split, "format": e.format
                                   if e.format != "auto" else data.format}), False


def load_rows(run, bucket=None, env: dict[str, str] | None = None, *, eval_set: bool = False,
              workdir: Path | None = None) -> list[dict[str, Any]]:
    """The prepared rows of the training set (or the eval set, its first maxRows)."""
    data = run.spec.data
    src, own = (eval_source(data) if eval_set else (data, False))
    limit = data.eval.max_rows if eval_set else None
    raw, source = read_rows(src, bucket, env, eval_set=own, limit=limit, workdir=workdir)
    return prepare_rows(raw, data, source)


def load_dataset(run, bucket=None, env: dict[str, str] | None = None,
                 workdir: Path | None = None):
    """The `datasets.Dataset` TRL's rollout worker iterates, in training order."""
    from datasets import Dataset

    rows = load_rows(run, bucket, env, workdir=workdir)
    t = run.spec.trainer
    order = epoch_order(len(rows), epochs_needed(len(rows), t.total_steps, t.prompts_per_step,
                                                 t.max_staleness), t.seed, run.spec.data.shuffle)
    return Dataset.from_list(rows).select(order)


def load_eval_rows(run, bucket=None, env: dict[str, str] | None = None,
                   workdir: Path | None = None) -> list[dict[str, Any]] | None:
    """The eval rows (in their order), or None without spec.data.eval."""
    if run.spec.data.eval is None:
        return None
    return load_rows(run, bucket, env, eval_set=True, workdir=workdir)
