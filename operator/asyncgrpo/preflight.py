"""Deep checks of a run before anything starts: what `asyncgrpo validate` cannot see.

`validate_run` checks the run file against itself. These checks look at what the file
names: the model (a local folder with a config.json, or a hub name whose config is in the
local cache or reachable under the run's hub settings), its tokenizer (a chat template the
rollout harness can use: TRL's own `add_response_schema`, and for tools a prefix-preserving
template), the data (the source exists, its first rows parse and carry the prompt field,
and each of their prompts, rendered as TRL renders it with the tools, fits maxModelLen
with maxCompletionTokens), and every user module (reward functions and an environment factory import and have a
signature TRL can call). Each problem is a `FieldError` on the field to change, so a typo
costs seconds instead of a vLLM or torchrun traceback minutes later.

Who runs them: `asyncgrpo validate --deep FILE` (where the user is), `asyncgrpo local run`
before it starts S3, vLLM or the trainer, and `asyncgrpo preflight --config FILE` (the same
checks, where the model, data and modules are reachable: in the trainer image, in the run's
namespace; docs/api.md describes the cluster preflight). Relative paths and modules resolve
from the current directory, as a local run's pods do (docs/local.md).

Import cost matters (the goal is an answer in seconds): transformers and TRL are imported
only when a tokenizer is checked, and nothing loads model weights.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.validation import FieldError

#: Rows of the data source that are parsed (and whose columns reward signatures must take).
PREVIEW_ROWS = 16
#: Keyword arguments TRL's rollout worker passes every reward function besides the columns.
REWARD_KWARGS = ("prompts", "completion_ids")
_TRUE = {"1", "true", "yes", "on"}


@dataclass
class PreflightReport:
    """Every problem found, notes on what could not be checked here, and how long each took."""

    errors: list[FieldError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors


def _env_of(run) -> dict[str, str]:
    """The variables the trainer sees that change how names resolve: the machine's, then
    the run's trainer and rollout env (HF_HUB_OFFLINE, HF_HOME, HF_ENDPOINT...)."""
    env = dict(os.environ)
    for var in [*run.spec.rollout.env, *run.spec.trainer.env]:
        if var.value is not None:
            env[var.name] = var.value
    return env


def _looks_like_path(name: str) -> bool:
    """A hub id is `name` or `namespace/name`; anything else (a leading '.', '/', '~', more
    than one '/') can only be a folder."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def check_model(run, env: dict[str, str] | None = None) -> Iterator[FieldError | str]:
    """spec.model.name resolves to a config: a local folder, or a hub id whose config.json
    is cached (offline) or at least a valid id (online: the pod downloads it)."""
    name = run.spec.model.name
    env = _env_of(run) if env is None else env
    at = "spec.model.name"
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            yield FieldError(at, f"{name} is a file; give the model's folder (with config.json)")
        elif not (p / "config.json").is_file():
            yield FieldError(at, f"{name} has no config.json: not a transformers model folder")
        return
    if _looks_like_path(name):
        yield FieldError(at, f"{name}: no such folder (relative paths resolve from "
                         f"{Path.cwd()})")
        return
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as e:
        yield FieldError(at, f"{name!r} is neither a folder nor a hub model id: {e}")
        return
    cache_dir = env.get("HF_HUB_CACHE") or (
        str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
    cached = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir)
    if isinstance(cached, str):
        return
    offline = any(env.get(k, "").lower() in _TRUE for k in ("HF_HUB_OFFLINE",
                                                             "TRANSFORMERS_OFFLINE"))
    if offline:
        yield FieldError(at, f"{name}: not in the local Hugging Face cache "
                         f"({cache_dir or 'the default HF_HOME'}) and HF_HUB_OFFLINE is set: "
                         "download it first (huggingface-cli download) or give a folder")
        return
    yield f"{at}: {name} is not in the local cache; it is downloaded from the hub at start"


def check_tokenizer(run, keep: list | None = None) -> Iterator[FieldError | str]:
    """The tokenizer of spec.model.name has a chat template TRL's rollout worker can use:
    it renders a user turn, TRL recognises it (`add_response_schema`, which the worker calls),
    and with tools it is prefix-preserving or TRL has a training variant of it. `keep`: a
    list the loaded tokenizer (with the run's chat template) is appended to."""
    at = "spec.model.name"
    name = run.spec.model.name
    env = _env_of(run)
    offline = any(env.get(k, "").lower() in _TRUE for k in ("HF_HUB_OFFLINE",
                                                             "TRANSFORMERS_OFFLINE"))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=offline or Path(name).exists())
    except Exception as e:  # noqa: BLE001 - any failure to load is the user's to fix
        yield FieldError(at, f"the tokenizer cannot be loaded: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:300]}")
        return
    from asyncgrpo.trainer.data import DataError, apply_chat_template

    m = run.spec.model
    try:
        apply_chat_template(tok, m)
    except DataError:
        return  # check_chat_template reports it
    if keep is not None:
        keep.append(tok)
    if m.chat_template is not None or m.chat_template_path is not None:
        at = "spec.model.chatTemplate" if m.chat_template else "spec.model.chatTemplatePath"
    if not getattr(tok, "chat_template", None):
        yield FieldError(at, "the tokenizer has no chat template (tokenizer_config.json "
                         "chat_template) and the run gives none: prompts are chat messages; "
                         "set spec.model.chatTemplate or chatTemplatePath")
        return
    turns = [{"role": "user", "content": "ping"}]
    if run.spec.data.system_prompt is not None:
        turns = [{"role": "system", "content": run.spec.data.system_prompt}, *turns]
    try:
        tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001
        what = "a system and a user turn" if len(turns) > 1 else "a user turn"
        yield FieldError(at, f"the chat template fails on {what}: {type(e).__name__}: "
                         f"{str(e)[:300]}")
        return
    if getattr(tok, "response_template", None) is None and getattr(
            tok, "response_schema", None) is None:
        from trl.chat_template_utils import add_response_schema

        try:
            add_response_schema(tok)
        except ValueError as e:
            yield FieldError(at, "the tokenizer's chat template is not one TRL's rollout "
                             "worker recognises, and the tokenizer sets no response_template: "
                             f"{str(e).split('. ')[0]}")
            return
    if run.spec.harness.type == "multi-turn" and (run.spec.harness.tools or _environment(run)):
        from trl.chat_template_utils import (
            get_training_chat_template,
            is_chat_template_prefix_preserving,
        )

        if not is_chat_template_prefix_preserving(tok):
            try:
                get_training_chat_template(tok)
            except ValueError:
                yield FieldError(at, "multi-turn with tools needs a prefix-preserving chat "
                                 "template; this one is not and TRL has no training variant")


def tool_functions(run) -> list:
    """The tools TRL's rollout worker renders into every prompt of a multi-turn run: the
    public functions of the environment's class (the user's `spec.harness.environment`, or
    the built-in sandbox tools `spec.harness.tools`), as TRL lists them; [] for single-turn
    or an environment that does not import (check_modules reports that)."""
    h = run.spec.harness
    if h.type != "multi-turn":
        return []
    env = _environment(run)
    try:
        if env is not None:
            from asyncgrpo.trainer.environments import load_environment_class

            cls = load_environment_class(env.module, getattr(env, "path", None))
        else:
            from asyncgrpo.sandbox.client.environment import TOOL_NAMES, environment_class

            cls = environment_class(tuple(h.tools) if h.tools else TOOL_NAMES)
    except Exception:  # noqa: BLE001 - reported by check_modules
        return []
    return [fn for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def check_prompt_lengths(run, tok, rows: list[dict[str, Any]]) -> Iterator[FieldError | str]:
    """Each of the first rows' prompt, as TRL's rollout worker renders it (the chat template
    with the tools' schemas and the generation prompt), plus maxCompletionTokens fits
    spec.rollout.maxModelLen: vLLM answers a longer request with a 400 and the rollout
    fails mid-run. Multi-turn: only the first turn can be checked here; the note says what
    is left for the later turns (their completions and tool results)."""
    r = run.spec.rollout
    limit, completion = r.max_model_len, r.sampling.max_completion_tokens
    tools = tool_functions(run)
    lengths = []
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        try:
            if isinstance(prompt, str):
                n = len(tok(prompt)["input_ids"])
            else:
                n = len(tok.apply_chat_template(prompt, tools=tools or None, tokenize=True,
                                                add_generation_prompt=True, return_dict=False))
        except Exception as e:  # noqa: BLE001 - the template's or the row's problem
            yield FieldError("spec.data", f"row {i}: its prompt does not render with the chat "
                             f"template{' and the tools' if tools else ''}: "
                             f"{type(e).__name__}: {str(e)[:200]}")
            return
        lengths.append(n)
    if not lengths:
        return
    longest = max(lengths)
    row = lengths.index(longest)
    with_tools = f" with the schemas of {len(tools)} tools" if tools else ""
    # TRL's multi-turn loop generates up to maxTurns + 1 times (max_tool_calling_iterations
    # tool rounds, then the answer), each request carrying every earlier turn
    turns = run.spec.harness.max_turns + 1 if tools else 1
    need = longest + turns * completion
    if need > limit:
        what = (f"with {turns} generations of up to maxCompletionTokens {completion} "
                f"(maxTurns {run.spec.harness.max_turns} tool rounds and the answer, each "
                "request carrying the earlier turns) that is at least"
                if turns > 1 else f"with maxCompletionTokens {completion} that is")
        yield FieldError("spec.rollout.maxModelLen", f"row {row} of the data renders to a "
                         f"{longest}-token prompt{with_tools}; {what} {need} tokens > "
                         f"maxModelLen {limit}, which vLLM refuses (HTTP 400): raise "
                         "spec.rollout.maxModelLen (and spec.trainer.tokenBudgetPerRank "
                         "with it) or shorten the prompts")
    elif turns > 1:
        yield (f"spec.rollout.maxModelLen: the longest first-turn prompt of the first "
               f"{len(lengths)} rows is {longest} tokens{with_tools}; {turns} generations "
               f"of {completion} tokens leave {limit - need} tokens for the tool results "
               "(keep the environment's results shorter than that)")


_SOURCE_KEYS = {"path": "path", "config_map": "configMap", "bucket_path": "bucketPath"}


def _source_field(src) -> str:
    return next((v for k, v in _SOURCE_KEYS.items() if getattr(src, k) is not None), "")


def _check_rows(run, bucket, *, eval_set: bool) -> tuple[list[FieldError | str],
                                                          list[dict[str, Any]]]:
    """(problems, first rows as the trainer makes them) of the training or the eval set."""
    from asyncgrpo.storage import StoreError
    from asyncgrpo.trainer.data import DataError, eval_source, prepare_rows, read_rows

    data = run.spec.data
    src, own = eval_source(data) if eval_set else (data, False)
    base = "spec.data.eval" if own else "spec.data"
    at = f"{base}.{_source_field(src)}"
    if src.config_map is not None and not Path(os.environ.get(wire.DATA_DIR_ENV)
                                               or wire.DATA_DIR).is_dir():
        # a ConfigMap is mounted into the trainer pod; only the pod can read it
        return [(f"{at}: not checked (read where the ConfigMap is mounted: the cluster "
                "preflight)")], []
    if src.bucket_path is not None and bucket is None:
        return [f"{at}: not checked (the bucket is not reachable from here)"], []
    try:
        raw, source = read_rows(src, bucket, eval_set=own, limit=PREVIEW_ROWS)
    except DataError as e:
        where = f"{'spec.data.eval' if eval_set else 'spec.data'}.{e.field}" if e.field else at
        return [FieldError(where, str(e))], []
    except StoreError as e:
        return [f"{at}: not checked ({e})"], []
    try:
        rows = prepare_rows(raw, data, source)
    except DataError as e:
        return [FieldError(f"spec.data.{e.field}" if e.field else at, str(e))], []
    out: list[FieldError | str] = []
    for name, col in data.columns.items():
        if col.pattern is None:
            continue
        misses = sum(r.get(name) is None for r in rows)
        if misses == len(rows):
            out.append(FieldError(f"spec.data.columns.{name}.pattern", f"matches none of the "
                                  f"first {len(rows)} rows of {source} (field {col.field!r})"))
        elif misses:
            out.append(f"spec.data.columns.{name}.pattern: no match in {misses} of the first "
                       f"{len(rows)} rows of {source} (those rows get null)")
    return out, rows


def check_data(run, bucket=None) -> tuple[list[FieldError | str], list[dict[str, Any]]]:
    """(problems, first rows as the trainer parses them): the source exists and is of its
    format, its first rows parse, each has the prompt (promptField, messagesField or the
    columns promptTemplate names) and the columns `columns` reads; the same for the eval
    set. `bucket`: a `storage.Bucket` of the whole bucket when one is reachable."""
    problems, rows = _check_rows(run, bucket, eval_set=False)
    if run.spec.data.eval is not None:
        more, _ = _check_rows(run, bucket, eval_set=True)
        problems = [*problems, *more]
    return problems, rows


def check_row_images(run, rows: list[dict[str, Any]]) -> Iterator[FieldError | str]:
    """The first rows' `spec.sandboxes.imageColumn` values are image references (or null:
    the run's own image). Whether each image has a python3 shows when its pod starts
    (`SandboxImageRefused`); a malformed reference is refused here, naming the row."""
    sb = run.spec.sandboxes
    if sb is None or sb.image_column is None or not rows:
        return
    col = sb.image_column
    where = (f"spec.data.columns.{col}" if col in run.spec.data.columns
             else "spec.sandboxes.imageColumn")
    if all(col not in r for r in rows):
        yield FieldError(where, f"no column {col!r} in the first {len(rows)} rows "
                         f"(columns: {', '.join(sorted(rows[0]))[:300]})")
        return
    images = set()
    for i, row in enumerate(rows):
        ref = row.get(col)
        if ref in (None, ""):
            continue
        problem = wire.image_reference_problem(ref)
        if problem:
            yield FieldError(where, f"row {i}: {problem}")
            return
        images.add(ref)
    if len(images) > sb.images.max_distinct:
        yield (f"spec.sandboxes.images.maxDistinct: the first {len(rows)} rows name "
               f"{len(images)} images, above maxDistinct {sb.images.max_distinct}: a lease for "
               "another image is refused (too_many_images) while that many are in use")


def check_chat_template(run) -> Iterator[FieldError]:
    """spec.model.chatTemplatePath exists (the text is checked with the tokenizer)."""
    from asyncgrpo.trainer.data import DataError, read_chat_template

    try:
        read_chat_template(run.spec.model)
    except DataError as e:
        yield FieldError(f"spec.model.{e.field}", str(e))


def _import(ref: str) -> Any:
    mod_name, _, attr = ref.partition(":")
    module = importlib.import_module(mod_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _environment(run) -> Any:
    """spec.harness.environment if this version of the model has it (added with the
    bring-your-own-environment work), else None."""
    return getattr(run.spec.harness, "environment", None)


def _kwargs_for(fn, names: set[str]) -> str | None:
    """Why `fn(completions, **{n: ... for n in names})` would fail to bind, or None."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C callable: nothing to check
    try:
        sig.bind([], **{n: None for n in names})
    except TypeError as e:
        return str(e)
    return None


def check_modules(run, columns: set[str] | None) -> Iterator[FieldError | str]:
    """Every `python` reward imports, is callable and takes TRL's call
    (`fn(completions, prompts=..., completion_ids=..., <every column>=..., <args>=...)`);
    `spec.harness.environment`'s factory imports and is callable. `columns`: the data
    set's columns besides the prompt (None: unknown, only TRL's own keywords are checked)."""
    for i, fn in enumerate(run.spec.reward.functions):
        if fn.name != "python" or not fn.module:
            continue
        at = f"spec.reward.functions[{i}].module"
        try:
            obj = _import(fn.module)
        except Exception as e:  # noqa: BLE001 - the user's module: any import error is theirs
            yield FieldError(at, f"{fn.module} cannot be imported: {type(e).__name__}: {e} "
                             "(locally the run's directory is on the path; on a cluster the "
                             "module must be in the trainer image)")
            continue
        if not callable(obj):
            yield FieldError(at, f"{fn.module} is a {type(obj).__name__}, not a function")
            continue
        names = set(REWARD_KWARGS) | set(columns or ()) | set(fn.args)
        why = _kwargs_for(obj, names)
        if why:
            yield FieldError(at, f"{fn.module} cannot take TRL's call fn(completions, "
                             f"{', '.join(f'{n}=...' for n in sorted(names))}): {why}; "
                             "accept **kwargs")
    env = _environment(run)
    ref = getattr(env, "module", None) if env is not None else None
    if ref:
        at = "spec.harness.environment.module"
        try:
            obj = _import(ref)
        except Exception as e:  # noqa: BLE001
            yield FieldError(at, f"{ref} cannot be imported: {type(e).__name__}: {e}")
            return
        if not callable(obj):
            yield FieldError(at, f"{ref} is a {type(obj).__name__}, not a factory")
        elif inspect.isclass(obj) and not callable(getattr(obj, "reset", None)):
            yield FieldError(at, f"{ref} has no reset(): TRL's environment protocol calls "
                             "reset(**row) at the start of each episode")


def _reachable_bucket(run, env: dict[str, str]):
    """A `storage.Bucket` of the run's bucket when credentials and an endpoint that answers
    are at hand (for a `bucketPath` data source), else None. Never waits long."""
    s = run.spec.adapter_store
    if not (env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_PROFILE")
            or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")):
        return None
    if s.endpoint:
        from urllib.parse import urlparse

        from asyncgrpo.local.net import listening

        u = urlparse(s.endpoint)
        if u.hostname in ("127.0.0.1", "localhost") and not listening(u.port or 80):
            return None
    from asyncgrpo import storage

    client = storage.client(env.get("AWS_ENDPOINT_URL_S3") or s.endpoint, s.region,
                            connect_timeout_s=2.0, read_timeout_s=10.0)
    return storage.Bucket(s.bucket, "", client, attempts=1)


def module_paths(run) -> list[str]:
    """Where the trainer finds the run's modules besides its image: the PYTHONPATH of
    `spec.trainer.env` (a local run's task folder) and `spec.harness.environment.path`,
    relative ones from the current directory (as a local run's pods resolve them)."""
    out = [p for var in run.spec.trainer.env if var.name == "PYTHONPATH" and var.value
           for p in var.value.split(os.pathsep) if p]
    env = _environment(run)
    if env is not None and getattr(env, "path", None):
        out.append(env.path)
    return [str(Path(p).expanduser().absolute()) for p in out]


def preflight(run, *, bucket=None, tokenizer: bool = True) -> PreflightReport:
    """Every deep check of one run; never raises for the run's own problems."""
    report = PreflightReport()
    env = _env_of(run)
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # user modules resolve from here, as locally
    for p in reversed(module_paths(run)):  # first, as on the trainer's path
        if p not in sys.path:
            sys.path.insert(0, p)

    def take(items, what: str) -> None:
        for item in items:
            (report.errors if isinstance(item, FieldError) else report.notes).append(item)

    def timed(what: str, fn):
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            report.seconds[what] = round(time.monotonic() - t0, 3)

    model_errors = timed("model", lambda: list(check_model(run, env)))
    take(model_errors, "model")
    tok: list = []
    if tokenizer and not any(isinstance(e, FieldError) for e in model_errors):
        take(timed("tokenizer", lambda: list(check_tokenizer(run, tok))), "tokenizer")
    take(check_chat_template(run), "chat template")
    ev = run.spec.data.eval
    if bucket is None and (run.spec.data.bucket_path or (ev is not None and ev.bucket_path)):
        bucket = _reachable_bucket(run, env)
    problems, rows = timed("data", lambda: check_data(run, bucket))
    take(problems, "data")
    columns = set().union(*(set(r) - {"prompt"} for r in rows)) if rows else None
    take(check_row_images(run, rows), "row images")
    take(timed("modules", lambda: list(check_modules(run, columns))), "modules")
    if tok and rows:
        take(timed("prompt lengths", lambda: list(check_prompt_lengths(run, tok[0], rows))),
             "prompt lengths")
    return report


def format_report(report: PreflightReport, prefix: str = "") -> list[str]:
    return [f"{prefix}{e}" for e in report.errors] + [f"{prefix}note: {n}" for n in report.notes]


# ---------------------------------------------------------------- `asyncgrpo preflight`


def register(sub) -> None:
    p = sub.add_parser("preflight", help="the deep checks of a run where its model, data and "
                       "modules are (the cluster's preflight Job); exit 1 on any error")
    p.add_argument("--config", type=Path, required=True, help="the run document")
    p.add_argument("--termination-log", type=Path, default=Path(wire.TERMINATION_LOG),
                   help="where the errors go as JSON for the operator (if it exists)")
    p.set_defaults(func=_preflight_command)


def _preflight_command(args) -> int:
    from asyncgrpo.api import RunValidationError, load_run

    try:
        run = load_run(args.config)
    except (OSError, RunValidationError) as e:
        print(f"{args.config}: {e}", file=sys.stderr)
        return 1
    report = preflight(run)
    for line in format_report(report):
        print(line, file=sys.stderr if not line.startswith("note") else sys.stdout)
    named = os.environ.get(wire.TERMINATION_LOG_ENV)   # a local pod's (placement) file
    target = Path(named or args.termination_log)
    if named or target.exists():
        try:
            target.write_text(json.dumps({"errors": [{"path": e.path, "message": e.message}
                                                     for e in report.errors]})[:4000])
        except OSError:
            pass
    return 0 if report.ok else 1
