"""SGLangServer (ucm/bench/engines/sglang_server.py) without SGLang: a stand-in
"python" that answers /model_info and names a socket file the way SGLang
does (tempfile.NamedTemporaryFile(delete=False)), which SGLang never
removes. The server's TMPDIR must be private and gone after stop()."""
import os
import sys
import tempfile
import textwrap

from ucm.bench.engines.sglang_server import SGLangServer

STAND_IN = textwrap.dedent("""\
    import http.server, json, sys, tempfile
    port = int(sys.argv[sys.argv.index("--port") + 1])
    tempfile.NamedTemporaryFile(delete=False)  # as SGLang names its IPC sockets

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"model_path": "stand-in"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


def test_the_servers_temp_files_go_with_it(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "launch_server.py").write_text(STAND_IN)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    shared = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("tmp")}
    srv = SGLangServer(sys.executable, "stand-in", pythonpath=[str(tmp_path)], log_path=str(tmp_path / "s.log"))
    with srv:
        private = srv.tmp_dir
        assert private is not None and os.path.dirname(private) == tempfile.gettempdir()
        assert len(os.listdir(private)) == 1  # the stand-in's "socket" went there
    assert srv.tmp_dir is None and not os.path.exists(private)
    assert {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("tmp")} - shared == set()


def test_stop_without_start_and_twice(tmp_path):
    srv = SGLangServer(sys.executable, "stand-in")
    srv.stop()
    srv.stop()
    assert srv.tmp_dir is None
