"""The hand-written stubs in typings/pyrage hold for the installed pyrage: every name they
declare exists and behaves as typed (a new pyrage that changes one fails here, not in use)."""

from __future__ import annotations

import ast
from pathlib import Path

import pyrage
import pytest

STUBS = Path(__file__).resolve().parents[1] / "typings" / "pyrage"


def declared(stub: Path) -> set[str]:
    tree = ast.parse(stub.read_text())
    return {node.name for node in tree.body
            if isinstance(node, ast.ClassDef | ast.FunctionDef)}


def test_every_stubbed_name_exists() -> None:
    assert declared(STUBS / "__init__.pyi") <= set(dir(pyrage))
    assert declared(STUBS / "x25519.pyi") <= set(dir(pyrage.x25519))


def test_the_stubbed_calls_behave_as_typed() -> None:
    identity = pyrage.x25519.Identity.generate()
    recipient = identity.to_public()
    assert isinstance(recipient, pyrage.x25519.Recipient)
    assert pyrage.x25519.Identity.from_str(str(identity)).to_public().__str__() == str(recipient)
    assert str(pyrage.x25519.Recipient.from_str(str(recipient))) == str(recipient)
    armored = pyrage.encrypt(b"value", [recipient], armored=True)
    assert isinstance(armored, bytes) and armored.startswith(b"-----BEGIN AGE")
    assert pyrage.decrypt(armored, [identity]) == b"value"
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt(armored, [pyrage.x25519.Identity.generate()])
    with pytest.raises(pyrage.RecipientError):
        pyrage.x25519.Recipient.from_str("age1nope")
    with pytest.raises(pyrage.IdentityError):
        pyrage.x25519.Identity.from_str("AGE-SECRET-KEY-1NOPE")
