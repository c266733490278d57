"""The vLLM engines' environment (ucm/apps/engine_env.py): their IPC sockets
go to the run's work dir, which the run removes, unless the user chose a
place; the benches' defaults."""
from ucm.apps.engine_env import bench_env, with_ipc_dir


def test_the_engines_ipc_sockets_go_to_the_work_dir_unless_the_user_chose_one(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    env = bench_env(tmp_path)
    assert env["VLLM_RPC_BASE_PATH"] == str(tmp_path / "ipc") and (tmp_path / "ipc").is_dir()
    assert "VLLM_RPC_BASE_PATH" not in bench_env()
    assert with_ipc_dir({}, tmp_path) == {"VLLM_RPC_BASE_PATH": str(tmp_path / "ipc")}
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/somewhere/else")
    assert bench_env(tmp_path)["VLLM_RPC_BASE_PATH"] == "/somewhere/else"
    assert with_ipc_dir({"VLLM_RPC_BASE_PATH": "/x"}, tmp_path)["VLLM_RPC_BASE_PATH"] == "/x"


def test_the_benches_defaults_give_way_to_the_users(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    env = bench_env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["HF_HUB_OFFLINE"] == "1"
