"""The service client's parts on their own: a link's check of the slots a
reply hands out, the cutting of calls into parts by the arena, and the
rule that the parts (cache_client, conn, link, slots, stream, spawn) use
each other only through public names, with no import cycle among them."""
import ast
import pathlib

import pytest

from ucm.service.client.link import Link, Mapping, ServiceUnavailable
from ucm.service.client.slots import arena_parts

CLIENT = pathlib.Path(__file__).resolve().parents[3] / "ucm" / "service" / "client"
ARENA = 1 << 20


def link(epoch=11):
    return Link(None, None, {"epoch": epoch}, Mapping(bytearray(ARENA)), ("arena", "a", 1, epoch), None, None,
                None, "/run/ucm.sock")


@pytest.mark.parametrize("reply, width", [
    ({"epoch": 11, "slots": [[0, 4096], None, [ARENA - 4096, 4096]]}, 2),
    ({"epoch": 11, "slots": [[7, 0, 4096], None, [8, 4096, 8192]]}, 3),
])
def test_slots_inside_the_arena_of_the_links_epoch_are_handed_out(reply, width):
    assert link().check_slots(reply, 3, width) == reply["slots"]


@pytest.mark.parametrize("reply", [
    {"epoch": 12, "slots": [[1, 0, 4096]]},  # another instance's
    {"epoch": 11, "slots": [[1, ARENA - 4095, 4096]]},  # past the arena's end
    {"epoch": 11, "slots": [[1, -4096, 4096]]},
    {"epoch": 11, "slots": [[1, 0, 0]]},  # empty
    {"epoch": 11, "slots": [[True, 0, 4096]]},  # a bool is not an integer
    {"epoch": 11, "slots": [[0, 4096]]},  # another width
    {"epoch": 11, "slots": [[1, 0, 4096], None]},  # another count
    [[1, 0, 4096]],  # the reply of an older protocol
    None,
])
def test_slots_for_another_arena_or_malformed_are_refused(reply):
    with pytest.raises(ServiceUnavailable, match="/run/ucm.sock"):
        link().check_slots(reply, 1, 3)


@pytest.mark.parametrize("sizes, arena_bytes, part_bytes, expected", [
    ([100] * 6, 1600, None, [(0, 2), (2, 4), (4, 6)]),  # 1/8 of the arena: 200 bytes a part
    ([100] * 6, 1600, 300, [(0, 2), (2, 4), (4, 6)]),  # the arena's bound is the smaller
    ([100] * 6, 80_000, 300, [(0, 3), (3, 6)]),  # part_bytes is the smaller
    ([100] * 3, 0, None, [(0, 1), (1, 2), (2, 3)]),  # no arena known: one block a part
    ([500, 10, 10], 1600, None, [(0, 1), (1, 3)]),  # a block larger than the bound goes alone
])
def test_calls_are_cut_by_an_eighth_of_the_arena(sizes, arena_bytes, part_bytes, expected):
    assert arena_parts(sizes, arena_bytes, part_bytes) == expected


def _modules():
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in CLIENT.glob("*.py") if p.stem != "__init__"}


def test_no_part_of_the_client_reaches_into_another_objects_private_names():
    reach = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                v = node.value
                if isinstance(v, ast.Name) and v.id in ("self", "cls", "_native"):
                    continue
                reach.append(f"{name}.py:{node.lineno} {ast.unparse(node)}")
    assert reach == []


def test_the_parts_of_the_client_import_each_other_without_a_cycle():
    pkg = "ucm.service.client."
    graph = {}
    for name, tree in _modules().items():
        deps = set()
        for node in ast.walk(tree):  # lazy and typing-only imports too
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith(pkg):
                    deps.add(node.module[len(pkg):])
                elif node.module == pkg[:-1]:
                    deps.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name[len(pkg):] for a in node.names if a.name.startswith(pkg))
        graph[name] = deps & set(_modules()) - {name}

    def reaches(start, goal, seen=()):
        return any(d == goal or (d not in seen and reaches(d, goal, seen + (d,))) for d in graph[start])

    assert [m for m in graph if reaches(m, m)] == [], graph
    assert graph["slots"] | graph["stream"] <= {"conn", "link"}  # the parts know nothing of the client
