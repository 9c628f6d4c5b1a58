"""The control channel between the two disagg processes (issue 26): every value signed under the run's key, nothing
unpickled, the store on loopback, and a third process that writes into it never gets a message accepted."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO, cpu_process_env, free_port
from kvlab import disagg
from kvlab.disagg import cuda_ipc, launch
from kvlab.disagg.protocol import KEY_ENV, Control, ControlIntegrityError, new_key, run_key

KEY = bytes.fromhex(new_key())


def _control(store=None, key=KEY, scope="kvlab") -> Control:
    return Control(store if store is not None else dist.HashStore(), 2.0, key, scope=scope)


class _Marker:
    """A pickle that, once loaded, writes a file: proof that something unpickled it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('loaded')",))


# -------------------------------------------------------------------------------------------- the signature


def test_a_signed_value_reads_back_and_every_other_is_refused_naming_the_key(tmp_path):
    c = _control()
    c.post("req0/done", {"token": 7})
    assert c.wait("req0/done", "done") == {"token": 7} == c.read("req0/done")
    assert c.read("req9/done") is None
    raw = c.store.get("req0/done")
    cases = {
        "unsigned": json.dumps({"token": 8}).encode(),
        "body changed": raw.replace(b'"token": 7', b'"token": 8'),
        "other key's value": c.seal("req0/go", {"token": 7}),  # a genuine value, replayed under another key
        "other run's value": _control(key=bytes.fromhex(new_key())).seal("req0/done", {"token": 7}),
        "other scope's value": _control(scope="kvlab/other-run").seal("req0/done", {"token": 7}),
        "cut short": raw[:-3],
        "empty": b"",
        "pickle": pickle.dumps(_Marker(tmp_path / "loaded")),
    }
    for why, value in cases.items():
        c.store.set("req0/done", value)
        with pytest.raises(ControlIntegrityError, match=r"^control key kvlab/req0/done: .* the run stops$"):
            c.wait("req0/done", "done")
        with pytest.raises(ControlIntegrityError):
            c.read("req0/done")
    assert not (tmp_path / "loaded").exists(), "a pickle in the store was loaded"


def test_a_deleted_key_is_a_timeout_naming_it():
    c = _control()
    c.post("req3/done", 1)
    c.store.delete_key("req3/done")
    with pytest.raises(TimeoutError, match=r"request 3's prefill \('req3/done'\)"):
        c.wait("req3/done", "request 3's prefill", timeout_s=0.2)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300))
def test_no_bytes_in_a_key_get_past_the_check(raw):
    """Whatever bytes a stranger writes, open() refuses them (it would take the run key to make a valid MAC)."""
    with pytest.raises(ControlIntegrityError):
        _control().open("req0/done", raw)


def test_the_run_key_comes_from_the_environment_checked():
    assert run_key({KEY_ENV: "ab" * 16}) == bytes.fromhex("ab" * 16)
    with pytest.raises(ValueError, match=f"^{KEY_ENV} is not set: under torchrun x needs it; set {KEY_ENV}"):
        run_key({}, where="under torchrun x")
    with pytest.raises(ValueError, match=r"\(16 characters\) is not hexadecimal \(character 2 ") as err:
        run_key({KEY_ENV: "azqxwvutsrponmlk"})
    assert "zqxw" not in str(err.value)  # the secret is never echoed
    with pytest.raises(ValueError, match="holds 4 bytes: at least 16"):
        run_key({KEY_ENV: "abcd1234"})
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Control(dist.HashStore(), 1.0, b"short")


def test_under_torchrun_a_missing_key_is_refused_before_the_folder_exists(monkeypatch, tmp_path):
    for k, v in {"TORCHELASTIC_RUN_ID": "t", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=f"^{KEY_ENV} is not set: under torchrun every process of the pair needs it"):
        disagg.run(disagg.DisaggConfig(), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    for name, value, says in (("RANK", "7", "RANK = '7': expected an integer ≥ 0 and ≤ 1"),
                              ("MASTER_PORT", "abc", "MASTER_PORT = 'abc': expected an integer ≥ 1 and ≤ 65535")):
        monkeypatch.setenv(KEY_ENV, "ab" * 32)
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"^{says}"):
            disagg.run(disagg.DisaggConfig(), tmp_path / "run", progress=False)
        monkeypatch.setenv(name, {"RANK": "0", "MASTER_PORT": "29999"}[name])
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ the listening side


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets listening on `port`."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in open(name).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.append(local.rsplit(":", 1)[0])
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")
def test_the_launchers_store_listens_on_loopback_only():
    """torch's TCPStore given 127.0.0.1 still listens on every interface; the launcher's listens on 127.0.0.1."""
    store = launch._store(0, 5.0)
    try:
        assert _listening(store.port) == ["0100007F"], _listening(store.port)  # 127.0.0.1, nothing else
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
        client.set("a", "b")
        assert store.get("a") == b"b"
    finally:
        del store


# ------------------------------------------------------------------------------------------ the CUDA IPC handle


def _fields(**kw) -> dict:
    f = {"size": [2, 3], "stride": [3, 1], "offset": 0, "storage": "TypedStorage", "dtype": "bfloat16", "device": 0,
         "handle": "AAEC", "size_bytes": 12, "offset_bytes": 0, "ref_handle": "L3RtcC94", "ref_offset": 0,
         "event": "AAAA", "event_sync": True}
    f.update(kw)
    return f


def test_the_cuda_ipc_handle_is_plain_fields_rebuilt_with_classes_chosen_here():
    args = cuda_ipc.check(_fields())
    assert args[0] is torch.Tensor and args[4] is torch.storage.TypedStorage and args[5] is torch.bfloat16
    assert args[1:4] == ((2, 3), (3, 1), 0) and args[7] == b"\x00\x01\x02" and args[10] is False
    json.dumps(_fields())  # what crosses the store is JSON
    bad = {"dtype": ("object", "dtype"), "storage": ("os.system", "storage"), "size": ([2, -1], "size"),
           "stride": ([1], "size and stride"), "handle": ("!!", "handle"), "offset": (True, "offset"),
           "event_sync": (1, "event_sync"), "device": (1.5, "device")}
    for field, (value, named) in bad.items():
        with pytest.raises(ValueError, match=f"^CUDA IPC field(s)? {named}"):
            cuda_ipc.check(_fields(**{field: value}))
    with pytest.raises(ValueError, match="fields \\['fn'\\] are missing or not expected"):
        cuda_ipc.check({**_fields(), "fn": "exec"})


@settings(max_examples=2000, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(_fields()) + ["fn"]),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                                    lambda c: st.lists(c, max_size=4), max_leaves=8)))
def test_any_fields_give_checked_arguments_or_one_valueerror(fields):
    try:
        cuda_ipc.check({**_fields(), **fields})
    except ValueError as err:
        assert "\n" not in str(err) and str(err).startswith("CUDA IPC")


def test_no_kvlab_module_unpickles():
    """Nothing kvlab reads is unpickled: no module imports pickle, and torch.load is called with weights_only."""
    for path in (REPO / "kvlab").rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, path
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{path}: {line.strip()}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_tensor_shared_as_fields_is_the_same_memory_in_another_process(tmp_path):
    """The decode side's export, rebuilt in a second process, writes into the first process's tensor."""
    t = torch.zeros(4, 1024, dtype=torch.bfloat16, device="cuda")
    fields = cuda_ipc.export(t)
    code = textwrap.dedent(f"""
        import json, torch
        from kvlab.disagg import cuda_ipc
        t = cuda_ipc.rebuild(json.loads({json.dumps(json.dumps(fields))}))
        assert t.shape == (4, 1024) and t.dtype == torch.bfloat16
        t.fill_(3.0)
        torch.cuda.synchronize()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    torch.cuda.synchronize()
    assert bool((t == 3.0).all())


# --------------------------------------------------------------------------------------- a third process writes

FORGER = textwrap.dedent("""
    import json, pickle, sys, time
    from datetime import timedelta
    import torch.distributed as dist

    port, mode, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]

    class Marker:
        def __reduce__(self):
            return (exec, (f"open({marker!r}, 'w').write('loaded')",))

    deadline = time.monotonic() + 90
    while True:
        try:
            s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
            break
        except Exception:
            if time.monotonic() > deadline:
                sys.exit("the run's store never came up")
            time.sleep(0.05)
    if mode == "replay":  # a genuine signed value of this very run, copied under other keys
        s.wait(["kvlab/req0/go"], timedelta(seconds=60))
        value = s.get("kvlab/req0/go")
    elif mode == "pickle":
        value = pickle.dumps(Marker())
    else:
        value = json.dumps({"first": 1, "stop": True}).encode()
    first = 1 if mode == "replay" else 0
    # written ahead: the decode side waits for each request's `done` before the prefill side posts it
    for n in range(first, 400):
        s.set(f"kvlab/req{n}/done", value)
    for n in range(first, 400):
        s.set(f"kvlab/req{n}/landed/u0", value)
    print("forged", flush=True)
""")


@pytest.mark.parametrize("mode", ["unsigned", "pickle", "replay"])
def test_a_third_process_writing_into_the_store_stops_the_run_closed_naming_the_key(mode, tmp_path):
    """A stranger on the store writes forged `done` messages (plain JSON, a pickle that would run code, a genuine
    value of this run copied under other keys) ahead of the prefill side: the decode side refuses the first it
    reads, the run stops in one line naming the key, no forged message is taken, and nothing is unpickled."""
    out, marker = tmp_path / "run", tmp_path / "loaded"
    env = cpu_process_env(tmp_path)
    port = free_port()
    run = subprocess.Popen([sys.executable, "-m", "kvlab", "disagg", "--repeats", "200", "--quiet", "--out", str(out),
                            "--port", str(port), "--timeout", "30"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    forger = subprocess.Popen([sys.executable, "-c", FORGER, str(port), mode, str(marker)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = run.communicate(timeout=240)
        f_out, f_err = forger.communicate(timeout=60)
    finally:
        for p in (run, forger):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
    assert "forged" in f_out, f_err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert run.returncode != 0 and len(lines) == 1, err
    assert "ControlIntegrityError: control key kvlab/req" in lines[0] and "/done:" in lines[0], lines[0]
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "failed" and (out / "STOPPED.txt").is_file()
    assert not (out / "requests.csv").exists() and not (out / "requests.csv.gz").exists()
    assert not marker.exists(), "a pickle in the store was loaded"


def test_text_a_stranger_writes_into_the_progress_key_moves_no_bar_and_the_store_still_works():
    """`progress` is signed like every value (an unsigned `store.add` counter with text in it makes the real
    store drop the next adding client's connection): on the launcher's own store, a stranger's text there is read
    as no count, and signed messages still go through afterwards."""
    store = launch._store(0, 5.0)
    try:
        c = Control(dist.PrefixStore("kvlab", store), 5.0, KEY, scope="kvlab")
        c.post("progress", 3)
        assert c.read("progress") == 3 and launch.progress_of(store.port) == 3
        stranger = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
        stranger.set("kvlab/progress", "not a number")
        with pytest.raises(ControlIntegrityError):
            c.read("progress")
        assert launch.progress_of(store.port) == 0
        c.post("req0/done", {"ok": True})
        assert c.wait("req0/done", "done") == {"ok": True}
    finally:
        del store
