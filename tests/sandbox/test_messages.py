"""The wire types' rules (`common.messages`, standard library only): what a request may hold,
what the 422 says, and the dict-like results. No server: the servers' use is in test_server.py."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from asyncgrpo.sandbox.common.http_guard import validate
from asyncgrpo.sandbox.common.messages import (
    ApiError,
    ExecRequest,
    ExecResult,
    HeartbeatsRequest,
    Invalid,
    LeaseRequest,
    ResetRequest,
    ScoreRequest,
    WriteRequest,
)


def errors(model, data) -> list[tuple[tuple, str]]:
    with pytest.raises(Invalid) as info:
        model.validate(data)
    return [(tuple(e["loc"]), e["msg"]) for e in info.value.errors]


@pytest.mark.parametrize(("data", "loc", "msg"), [
    ({}, ("command",), "Field required"),
    ({"command": "true", "surprise": 1}, ("surprise",), "Extra inputs are not permitted"),
    ({"command": 5}, ("command",), "Input should be a valid string or a valid list"),
    ({"command": ["a", 5]}, ("command", 1), "Input should be a valid string"),
    ({"command": " "}, ("command",), "Value error, command is empty"),
    ({"command": []}, ("command",), "Value error, command is empty"),
    ({"command": ["a\x00b"]}, ("command",), "Value error, command contains NUL"),
    ({"command": "a\x00"}, ("command",), "Value error, command contains NUL"),
    ({"command": "x", "env": {"A=B": "x"}}, ("env",), "Value error, invalid environment variable 'A=B'"),
    ({"command": "x", "env": {"A": "x\x00"}}, ("env",), "Value error, invalid environment variable 'A'"),
    ({"command": "x", "env": {"A": 5}}, ("env", "A"), "Input should be a valid string"),
    ({"command": "x", "timeout_seconds": 0}, ("timeout_seconds",), "Input should be greater than 0"),
    ({"command": "x", "timeout_seconds": "5"}, ("timeout_seconds",), "Input should be a valid number"),
    ({"command": "x", "timeout_seconds": True}, ("timeout_seconds",), "Input should be a valid number"),
    ({"command": "x", "max_output_bytes": -1}, ("max_output_bytes",), "Input should be greater than or equal to 0"),
    ({"command": "x", "max_output_bytes": True}, ("max_output_bytes",), "Input should be a valid integer"),
    ({"command": "x", "max_output_bytes": 5.0}, ("max_output_bytes",), "Input should be a valid integer"),
    ({"command": "x", "output_encoding": "latin-1"}, ("output_encoding",), "Input should be 'utf-8' or 'base64'"),
    ({"command": "x", "stdin": b"x"}, ("stdin",), "Input should be a valid string"),
])
def test_exec_requests_keep_the_rules(data, loc, msg):
    assert errors(ExecRequest, data) == [(loc, msg)]


def test_the_other_requests_keep_their_bounds():
    assert errors(WriteRequest, {"path": "a", "content": "b", "mode": 0o1000}) == [
        (("mode",), "Input should be less than or equal to 511")]
    assert errors(ResetRequest, {"lease_secret": "short"}) == [
        (("lease_secret",), "String should have at least 16 characters")]
    assert errors(LeaseRequest, {"group_id": ""}) == [(("group_id",), "String should have at least 1 character")]
    assert errors(LeaseRequest, {"group_id": "g", "wait_seconds": -1}) == [
        (("wait_seconds",), "Input should be greater than or equal to 0")]
    assert errors(LeaseRequest, {"group_id": "g", "image": ""}) == [
        (("image",), "String should have at least 1 character")]
    assert errors(LeaseRequest, {"group_id": "g", "image": "r/" + "x" * 511}) == [
        (("image",), "String should have at most 512 characters")]
    assert LeaseRequest.validate({"group_id": "g"}).image is None
    assert LeaseRequest.validate({"group_id": "g", "image": "python:3.12"}).image == "python:3.12"
    assert errors(ScoreRequest, {"command": "x", "editable": ["a"] * 1025}) == [
        (("editable",), "List should have at most 1024 items, not 1025")]
    assert errors(HeartbeatsRequest, {"leases": [{"lease_id": "", "secret": "s", "z": 1}, 5]}) == [
        (("leases", 0, "lease_id"), "String should have at least 1 character"),
        (("leases", 0, "z"), "Extra inputs are not permitted"),
        (("leases", 1), "Input should be a valid dictionary or instance of HeldLease")]
    assert errors(ExecRequest, [1]) == [((), "Input should be a valid dictionary or instance of ExecRequest")]
    beats = HeartbeatsRequest.validate({"leases": [{"lease_id": "a", "secret": "b"}]})
    assert beats.leases[0].secret == "b" and beats.dump() == {"leases": [{"lease_id": "a", "secret": "b"}]}


def test_a_request_sends_what_was_set_and_ints_become_floats():
    req = ExecRequest.validate({"command": ["ls", "-l"], "timeout_seconds": 5})
    assert req.timeout_seconds == 5.0 and isinstance(req.timeout_seconds, float)
    assert req.env == {} and req.output_encoding == "utf-8" and req.stdin is None
    assert req.body() == {"command": ["ls", "-l"], "timeout_seconds": 5.0}
    req.timeout_seconds = 9.0  # assigning sets it (the gateway caps a proxied exec's timeout so)
    req.cwd = "sub"
    assert req.body() == {"command": ["ls", "-l"], "timeout_seconds": 9.0, "cwd": "sub"}
    built = ExecRequest(command="echo é", stdin="in", env={"A": "1"})
    assert built.stream_head() == b'{"command":"echo \\u00e9","env":{"A":"1"}}\n'
    assert json.loads(built.stream_head()) == {"command": "echo é", "env": {"A": "1"}}
    with pytest.raises(Invalid):
        ExecRequest(command="")
    # the client builds without checks: the server's 422 is the one answer to a bad exec
    assert ExecRequest.unchecked(command="", timeout_seconds="x").body() == {"command": "", "timeout_seconds": "x"}


def test_results_index_like_dicts_and_keep_extra_keys():
    d = {"exit_code": 0, "stdout": "o", "stderr": "", "stdout_truncated": False, "stderr_truncated": False,
         "stdout_bytes": 1, "stderr_bytes": 0, "timed_out": False, "duration_seconds": 1, "newer_key": [1]}
    r = ExecResult.validate(d)
    assert r["exit_code"] == 0 and r.stdout == "o" and r.get("newer_key") == [1] and r["newer_key"] == [1]
    assert r.duration_seconds == 1.0 and r.output_encoding == "utf-8" and r.get("absent", 7) == 7
    with pytest.raises(KeyError):
        r["absent"]
    assert r.dump() == {**d, "duration_seconds": 1.0, "output_encoding": "utf-8"}
    assert ExecResult.validate(d) == r
    again = pickle.loads(pickle.dumps(r))
    assert again == r and again.fields_set == r.fields_set and copy.deepcopy(r) == r
    odd = ExecResult.validate({**d, "get": 1, "dump": 2, "_fields_set": 3})  # never over a method
    assert odd.get("exit_code") == 0 and odd.dump()["stdout"] == "o" and odd.fields_set >= {"stdout"}
    assert ("stdout",) in [tuple(e["loc"]) for e in pytest.raises(Invalid, ExecResult.validate,
                                                                       {"exit_code": None}).value.errors]


def test_the_422_carries_the_first_ten_errors():
    with pytest.raises(ApiError) as info:
        validate({"command": "x", **{f"extra{i}": i for i in range(12)}}, ExecRequest)
    err = info.value
    assert err.status == 422 and err.error == "invalid_request"
    assert err.body()["detail"]["detail"][:2] == [{"loc": ["extra0"], "msg": "Extra inputs are not permitted"},
                                                  {"loc": ["extra1"], "msg": "Extra inputs are not permitted"}]
    assert len(err.detail) == 10
    json.dumps(err.body())  # JSON-ready as it is
