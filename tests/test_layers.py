"""The import rule of ``[tool.importlinter]`` in pyproject.toml holds, and its contracts can fail.

hlb's parts import only downward (``cli -> bench -> export -> sim -> daemon -> v1``), so do the
daemon's stages (``main -> cells -> runtime -> serve -> ingest | record -> decide -> state -> bus ->
config | logs -> errors``), and no package's modules import each other in a circle. ``make lint``
runs the same check.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import grimp
import pytest
from importlinter.api import read_configuration
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.layers import LayersContract
from importlinter.domain.contract import Contract

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
KINDS: dict[str, type[Contract]] = {"layers": LayersContract, "acyclic_siblings": AcyclicSiblingsContract}


def test_lint_imports_keeps_every_contract() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint_imports), "--config", str(PYPROJECT), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@pytest.fixture(scope="module")
def contracts() -> dict[str, Contract]:
    """The contracts of pyproject.toml by id, as lint-imports builds them."""
    config: dict[str, Any] = read_configuration(str(PYPROJECT))
    session = config["session_options"]
    built = {}
    for options in config["contracts_options"]:
        kind = KINDS[options["type"]]
        built[options["id"]] = kind(name=options["name"], session_options=session, contract_options=options)
    assert set(built) == {"parts", "stages", "acyclic"}
    return built


@pytest.fixture(scope="module")
def code() -> grimp.ImportGraph:
    """hlb's import graph as the code is now."""
    return grimp.build_graph("hlb", cache_dir=None)


def _kept(contract: Contract, code: grimp.ImportGraph, *imports: tuple[str, str]) -> bool:
    """Whether ``contract`` holds on ``code`` with ``imports`` (importer, imported) added."""
    graph = copy.deepcopy(code)  # a contract's check may change the graph it is given
    for importer, imported in imports:
        graph.add_import(importer=importer, imported=imported)
    return contract.check(graph, verbose=False).kept


def test_the_contracts_hold_on_the_code_as_it_is(contracts: dict[str, Contract], code: grimp.ImportGraph) -> None:
    assert all(_kept(contract, code) for contract in contracts.values())


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("hlb.daemon.state.graph", "hlb.sim.simulator"),  # the daemon reaching into the simulator
        ("hlb.sim.simulator", "hlb.export.model"),  # the simulator needing torch
        ("hlb.v1.events_pb2", "hlb.daemon.config"),  # the wire contract importing the product
    ],
)
def test_an_import_up_the_parts_breaks_the_parts_contract(
    contracts: dict[str, Contract], code: grimp.ImportGraph, importer: str, imported: str
) -> None:
    assert not _kept(contracts["parts"], code, (importer, imported))


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("hlb.daemon.runtime.daemon", "hlb.daemon.cells.host"),  # the circle `hlb serve` once had
        ("hlb.daemon.state.graph", "hlb.daemon.decide.scheduler"),  # the graph calling into a decision
        ("hlb.daemon.ingest.pipeline", "hlb.daemon.record.journal"),  # two siblings of one layer
        ("hlb.daemon.config", "hlb.daemon.logs"),  # ... at the bottom too
        ("hlb.daemon.errors", "hlb.daemon.config"),
    ],
)
def test_an_import_up_the_stages_breaks_the_stages_contract(
    contracts: dict[str, Contract], code: grimp.ImportGraph, importer: str, imported: str
) -> None:
    assert not _kept(contracts["stages"], code, (importer, imported))


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("hlb.daemon.runtime.publish", "hlb.daemon.runtime.daemon"),  # two modules of one package
        ("hlb.daemon.cells.bus", "hlb.daemon.cells.host"),
        ("hlb.daemon.state.ledger", "hlb.daemon.runtime.daemon"),  # two subpackages of one package
    ],
)
def test_a_circle_among_a_packages_modules_breaks_the_acyclic_contract(
    contracts: dict[str, Contract], code: grimp.ImportGraph, importer: str, imported: str
) -> None:
    assert not _kept(contracts["acyclic"], code, (importer, imported))
