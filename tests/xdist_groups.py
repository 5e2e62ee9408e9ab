"""``--dist loadgroup`` for pytest 9.2: pytest-xdist 3.8 sends the tests of one ``xdist_group``
to one worker by appending ``@<group>`` to their node ids, but pytest 9.2's node ids are
structured and xdist's assignment no longer takes (pytest-xdist issue 1386): the groups were
silently spread over the workers. Called from tests/conftest.py on every worker; a no-op outside
``--dist loadgroup`` and once xdist adds the suffix itself."""

from __future__ import annotations


def group_suffix(item) -> str:
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    return "@" + "_".join(names) if names else ""


def pytest_collection_modifyitems(config, items) -> None:
    if not config.getoption("loadgroup", default=False):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        suffix = group_suffix(item)
        if suffix and not item.nodeid.endswith(suffix):
            item._id = coerce_node_id(item.nodeid + suffix)
