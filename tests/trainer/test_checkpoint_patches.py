"""Checkpoint protocol on a real S3 server, retry/backoff against an unreachable one, and the
TRL patch module."""

from __future__ import annotations

import json
import uuid

import pytest

from asyncgrpo.storage import Bucket, StoreRequestError, StoreUnavailable, retry
from asyncgrpo.storage import client as s3_client
from asyncgrpo.trainer.checkpoint import COMPLETE, CheckpointStore, step_dir
from tests.conftest import free_port


@pytest.fixture
def ckpts(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    s3_server.client().create_bucket(Bucket=name)
    return CheckpointStore(Bucket(name, "pre/run-a", s3_client(s3_server.endpoint, "us-east-1"),
                                  attempts=2, backoff_s=0.01), keep=2)


def fake_checkpoint(root, step: int, ranks=(0,)):
    d = root / f"checkpoint-{step}"
    (d / "sub").mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(b"w" * (step + 1))
    (d / "rollout_state.json").write_text(json.dumps({"prompt_index": step * 2,
                                                      "model_version": step + 1}))
    (d / "sub" / "x.bin").write_bytes(b"x")
    for r in ranks:
        (d / f"rng_state_{r}.pth").write_bytes(bytes([r]))
    return d


def test_latest_is_the_newest_complete_one_and_download_restores_files(ckpts, tmp_path):
    assert ckpts.latest() is None
    ckpts.upload(fake_checkpoint(tmp_path, 2), 2, meta={"model_version": 3})
    # A trainer killed mid-upload: files of step 4, no COMPLETE.
    ckpts.bucket.upload(fake_checkpoint(tmp_path / "b", 4) / "rollout_state.json",
                        ckpts.root + step_dir(4) + "/rollout_state.json")
    assert ckpts.latest() == 2
    assert ckpts.info(2)["model_version"] == 3
    got = ckpts.download(2, tmp_path / "restore")
    assert got.name == "checkpoint-2"
    assert json.loads((got / "rollout_state.json").read_text())["prompt_index"] == 4
    assert (got / "sub" / "x.bin").read_bytes() == b"x"
    assert not (got / COMPLETE).exists()


def test_prune_keeps_newest_complete_and_drops_old_partials(ckpts, tmp_path):
    for s in (1, 2, 3):
        ckpts.upload(fake_checkpoint(tmp_path / str(s), s), s)
    keys = ckpts.bucket.list(ckpts.root)
    assert not any(step_dir(1) in k for k in keys)
    assert ckpts.latest() == 3 and any(step_dir(2) in k for k in keys)


def test_each_rank_uploads_its_own_rng_state_and_rank0_marks_complete(ckpts, tmp_path):
    d = fake_checkpoint(tmp_path, 5, ranks=(0, 1))
    ckpts.upload(d, 5, rank=1, is_main=False)
    assert ckpts.latest() is None  # only rank 0 writes COMPLETE
    names = {k.rsplit("/", 1)[-1] for k in ckpts.bucket.list(ckpts.root)}
    assert names == {"rng_state_1.pth"}
    ckpts.upload(d, 5, rank=0, is_main=True)
    files = ckpts.info(5)["files"]
    assert "rng_state_0.pth" in files and "rng_state_1.pth" in files


def test_unreachable_bucket_retries_with_backoff_then_says_so(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "dummy")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "dummy")
    port = free_port()  # nothing listens there
    b = Bucket("bkt", "r", s3_client(f"http://127.0.0.1:{port}", "us-east-1"), attempts=3,
               backoff_s=0.01)
    seen = []
    b.on_retry = lambda what, err: seen.append(what)
    with pytest.raises(StoreUnavailable, match=r"s3://bkt/r/x.*after 3 attempts"):
        b.get_bytes("r/x")
    assert len(seen) == 3


def test_permanent_errors_are_not_retried(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    calls = []
    b = Bucket("no-such-bucket-here", "r", s3_client(s3_server.endpoint, "us-east-1"),
               attempts=5, backoff_s=0.01, on_retry=lambda *a: calls.append(a))
    with pytest.raises(StoreRequestError, match=r"s3://no-such-bucket-here/r/x.*NoSuchBucket"):
        b.get_bytes("r/x")
    assert calls == []


def test_retry_recovers_after_transient_failures():
    n = {"calls": 0}

    def flaky():
        n["calls"] += 1
        if n["calls"] < 3:
            raise ConnectionError("refused")
        return "ok"

    assert retry("x", flaky, attempts=5, backoff_s=0.001) == "ok" and n["calls"] == 3


def test_patches_pin_trl_and_fix_cpu_init():
    import trl
    from trl.experimental.async_grpo import async_grpo_trainer as agt
    from trl.experimental.async_grpo import async_rollout_worker as arw

    from asyncgrpo.trainer import patches

    assert trl.__version__ == patches.TRL_VERSION
    patches.apply()
    patches.apply()  # idempotent

    class Acc:
        device = __import__("torch").device("cpu")

    assert agt.get_peak_flops_per_device(Acc(), "float32") is None
    assert arw.is_vllm_available() is True


def test_patches_refuse_another_trl(monkeypatch):
    import trl

    from asyncgrpo.trainer import patches

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(patches.UnsupportedTRL, match="trl==1.16.0"):
        patches._check_version()


def test_trl_config_from_the_run(tmp_path):
    from asyncgrpo.api import parse_run
    from asyncgrpo.trainer.main import trl_config
    from asyncgrpo.trainer.runtime_env import RuntimeEnv

    run = parse_run({
        "metadata": {"name": "cfg"},
        "spec": {"model": {"name": "m", "dtype": "float32"},
                 "adapterStore": {"bucket": "bkt"}, "data": {"path": "/d"},
                 "trainer": {"numGenerations": 4, "promptsPerStep": 3, "maxStaleness": 2,
                             "totalSteps": 50, "checkpointInterval": 10, "learningRate": 0.001,
                             "tokenBudgetPerRank": 4096, "clipEpsilon": 0.3},
                 "rollout": {"sampling": {"maxCompletionTokens": 64, "temperature": 0.7}},
                 "reward": {"functions": [{"name": "exact_match"}]}},
    })
    env = RuntimeEnv.from_env({"ASYNCGRPO_VLLM_URL": "http://v:8000",
                               "ASYNCGRPO_WORK_DIR": str(tmp_path), "ASYNCGRPO_MAX_STEPS": "7"})
    cfg = trl_config(run, env, use_cpu=True)
    assert cfg.vllm_server_base_url == "http://v:8000"
    assert cfg.max_steps == 7 and cfg.save_steps == 10 and cfg.max_staleness == 2
    assert cfg.queue_maxsize == 12  # one step of samples, not upstream's 1024
    assert cfg.token_budget == 4096 and cfg.epsilon == 0.3 and cfg.temperature == 0.7
    assert cfg.max_completion_length == 64 and cfg.learning_rate == 0.001
    # a float32 run computes in float32 (TRL's config would autocast it to bf16)
    assert cfg.bf16 is False and cfg.fp16 is False


def test_multi_turn_runs_get_the_sandbox_harness():
    from asyncgrpo.api import parse_run
    from asyncgrpo.trainer.main import environment_factory
    from asyncgrpo.trainer.runtime_env import RuntimeEnv

    base = {"model": {"name": "m"}, "adapterStore": {"bucket": "bkt"}, "data": {"path": "/d"},
            "reward": {"functions": [{"name": "exact_match"}]}}
    env = RuntimeEnv.from_env({"ASYNCGRPO_GATEWAY_URL": "http://gw:8080"})
    assert environment_factory(parse_run({"spec": base}), env) is None
    run = parse_run({"spec": {**base, "harness": {"type": "multi-turn", "maxTurns": 4,
                                                  "tools": ["shell", "write_file"]},
                              "sandboxes": {"execTimeoutSeconds": 30}}})
    factory = environment_factory(run, env)
    assert factory.config.tools == ("shell", "write_file")
    assert factory.config.gateway_url == "http://gw:8080"
    assert factory.config.num_generations == run.spec.trainer.num_generations
    import pickle

    pickle.dumps(factory)  # TRL pickles it into the rollout child


class _Forwarder:
    """A TCP forwarder on loopback: the bucket's address comes up when it starts."""

    def __init__(self, listen_port: int, target_port: int):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", listen_port))
        self.sock.listen(16)
        self.target = target_port
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _pipe(self, a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def _accept(self):
        import socket
        import threading

        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    def close(self):
        self.closed = True
        self.sock.close()


def test_publish_waits_out_a_bucket_outage(s3_server, tmp_path, monkeypatch):
    """The bucket is unreachable when the step ends and comes back later: the publish
    retries until it is in (no step lost), reporting each failure. Real moto behind a
    loopback forwarder that starts only after a few failed tries."""
    import threading

    from asyncgrpo.adapters.store import AdapterStore
    from asyncgrpo.adapters.tiny import save_random_adapter
    from asyncgrpo.trainer.grpo import publish_until_done
    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    bucket = f"late-{uuid.uuid4().hex[:8]}"
    s3_server.client().create_bucket(Bucket=bucket)
    base = save_tiny_checkpoint(tmp_path / "base")
    save_random_adapter(base, tmp_path / "adapter", seed=1)
    port = free_port()
    store = AdapterStore(bucket, run="r", endpoint_url=f"http://127.0.0.1:{port}", attempts=1,
                         backoff_s=0.01, connect_timeout_s=1)
    failures: list[str] = []
    forwarders = []

    def bring_up():
        while len(failures) < 3:  # the outage is observed a few times first
            threading.Event().wait(0.05)
        forwarders.append(_Forwarder(port, s3_server.port))

    t = threading.Thread(target=bring_up)
    t.start()
    try:
        manifest = publish_until_done(store, tmp_path / "adapter", 1, step=4, backoff_s=0.05,
                                      max_backoff_s=0.2,
                                      on_retry=lambda what, err: failures.append(what))
        assert len(failures) >= 3
        assert manifest.version == 1 and store.latest() == 1
        assert store.manifest(1).step == 4
    finally:
        t.join()
        for f in forwarders:
            f.close()


def test_unreachable_bucket_leaves_no_complete_checkpoint_and_does_not_raise(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "dummy")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "dummy")
    b = Bucket("bkt", "r", s3_client(f"http://127.0.0.1:{free_port()}", "us-east-1"),
               attempts=2, backoff_s=0.01)
    assert CheckpointStore(b).upload(fake_checkpoint(tmp_path, 3), 3) is False


def test_a_completion_the_parser_cannot_read_as_one_message_is_kept_as_text():
    """TRL's parse_response calls .get on whatever the tokenizer's parser returns; a list
    (the tiny random model's multi-turn output, once in CI) raised AttributeError and killed
    the rollout. The wrapper keeps such a completion as a plain assistant message."""
    from trl.experimental.async_grpo import async_rollout_worker as arw

    from asyncgrpo.trainer import patches
    from asyncgrpo.trainer.patches import tolerant_parse_response

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "text of " + ",".join(map(str, ids))

    def as_a_list(tok, ids, prefix=None, tools=None):
        return [].get("content")  # what TRL's hot-fix line does with a list

    def truncated(tok, ids, prefix=None, tools=None):
        raise ValueError("parse_response returned None")

    def fine(tok, ids, prefix=None, tools=None):
        return {"role": "assistant", "content": "ok", "tool_calls": [{"x": 1}]}

    for upstream in (as_a_list, truncated):
        assert tolerant_parse_response(upstream)(Tok(), [1, 2]) == {
            "role": "assistant", "content": "text of 1,2"}
    assert tolerant_parse_response(fine)(Tok(), [1])["tool_calls"] == [{"x": 1}]
    patches.apply()
    assert hasattr(arw.parse_response, "__wrapped__")
