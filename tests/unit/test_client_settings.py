"""The client's settings are declared once (:class:`~wsync_grpc.trainer.settings.Settings`) and everything else agrees.

The constructor's keywords, the client's public attributes, the per-sync overrides and the rank program's options
(``python -m wsync_grpc.tools.fsdp_rank``) each read the declaration; these tests check that they agree with it.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
from mypy import api as mypy_api

from wsync_grpc.tools import fsdp_rank
from wsync_grpc.trainer import TrainerClient
from wsync_grpc.trainer.settings import (
    KEYWORDS,
    SETTINGS,
    ClientSettings,
    SettingAttribute,
    client_settings,
    setting_docs,
    spec,
)

CONSTRUCTOR = inspect.signature(TrainerClient.__init__).parameters
NOT_SETTINGS = {
    "self",
    "targets",
    "token",
    "credentials",
    "channel_options",
    "keepalive",
    "keep_buffers",
    "owner",
    "metrics_registry",
    "sender",
    "peers",
    "policy",
}
"""The constructor's parameters that are not settings (a new keyword is one or the other)."""


@pytest.mark.parametrize("f", SETTINGS, ids=lambda f: f.name)
def test_every_setting_is_a_constructor_keyword_with_the_declared_default(f: dataclasses.Field[object]) -> None:
    p = CONSTRUCTOR[spec(f).keyword]
    assert p.kind is inspect.Parameter.KEYWORD_ONLY
    assert p.default is not inspect.Parameter.empty, "every setting has a default"
    assert p.default == spec(f).given
    if spec(f).keyword == f.name and p.default is not None and p.default != "":
        assert p.default == f.default, "a keyword that resolves nothing defaults to the field's default"


def test_the_constructor_settings_are_the_declared_ones_in_order() -> None:
    settings = [name for name in CONSTRUCTOR if name not in NOT_SETTINGS]
    assert settings == [spec(f).keyword for f in SETTINGS]
    assert set(KEYWORDS) == set(settings)
    names = list(CONSTRUCTOR)
    run = names[names.index("master_address") : names.index("delta_fallback") + 1]
    assert run == settings, "one run of keywords"


@pytest.mark.parametrize("f", SETTINGS, ids=lambda f: f.name)
def test_every_setting_is_a_public_attribute_over_the_client_settings(f: dataclasses.Field[object]) -> None:
    attr = inspect.getattr_static(TrainerClient, f.name)
    assert isinstance(attr, SettingAttribute)
    assert attr.__doc__ == setting_docs()[f.name]
    with TrainerClient(["127.0.0.1:1"]) as c:
        assert getattr(c, f.name) == getattr(c._settings, f.name)
        if spec(f).assignable:
            setattr(c, f.name, getattr(c, f.name))
        else:
            with pytest.raises(AttributeError, match="read at construction"):
                setattr(c, f.name, getattr(c, f.name))


def test_an_assigned_setting_is_what_every_part_reads() -> None:
    with TrainerClient(["127.0.0.1:1"], rpc_timeout_s=5.0) as c:
        assert c.rpc_timeout_s == 5.0
        c.rpc_timeout_s = 7.5
        c.bucket_bytes = 1 << 20
        assert c._settings.timeouts.rpc_s == 7.5
        assert c._settings.bucket_bytes == 1 << 20


def test_a_client_given_no_settings_has_the_declared_defaults_on_the_cpu() -> None:
    with TrainerClient(["127.0.0.1:1"]) as c:
        assert c._settings == ClientSettings()


@pytest.mark.parametrize("f", SETTINGS, ids=lambda f: f.name)
def test_every_setting_is_documented_with_its_unit(f: dataclasses.Field[object]) -> None:
    doc = setting_docs()[f.name]
    assert doc
    if f.name.endswith("_s"):
        assert "in seconds" in doc.split("\n\n")[0]
    if f.name.endswith("_bytes") or f.name == "alignment":
        assert "in bytes" in doc.split("\n\n")[0]


def test_the_per_sync_override_is_the_declared_setting() -> None:
    """``sync(bucket_bytes=None, delta=None)`` are the client's ``bucket_bytes`` and ``delta``; each override has the
    setting's name and type."""
    sync = inspect.signature(TrainerClient.sync).parameters
    overrides = [name for name in sync if name in KEYWORDS]
    assert overrides == ["bucket_bytes", "delta"]
    for name, kind in (("bucket_bytes", "int"), ("delta", "bool")):
        assert sync[name].default is None
        assert sync[name].annotation == f"{kind} | None"
        assert inspect.signature(TrainerClient.__init__).parameters[name].annotation == kind


def test_the_rank_program_takes_its_client_options_from_the_declaration() -> None:
    args = fsdp_rank.parse_args(["--rank=0", "--world=1", "--master-port=1", "--targets=127.0.0.1:1"])
    defaults = {f.name: f.default for f in SETTINGS}
    assert fsdp_rank.CLIENT_OPTIONS
    for name in fsdp_rank.CLIENT_OPTIONS:  # the declaration's, but where the program declares its own
        assert getattr(args, name) == fsdp_rank.RANK_DEFAULTS.get(name, defaults[name]), name
        assert type(getattr(args, name)) is type(defaults[name]), name
    assert set(fsdp_rank.RANK_DEFAULTS) <= set(fsdp_rank.CLIENT_OPTIONS)
    given = fsdp_rank.parse_args(
        ["--rank=0", "--world=1", "--master-port=1", "--targets=x", "--bucket-bytes=4000000", "--rpc-timeout-s=3"]
    )
    assert (given.bucket_bytes, given.rpc_timeout_s, given.group_timeout_s) == (
        4000000,
        3.0,
        fsdp_rank.RANK_DEFAULTS["group_timeout_s"],
    )


def test_client_settings_takes_the_constructor_keywords_and_keeps_its_checks() -> None:
    s = client_settings(["a:1", "b:1"], workers=(1, 2), group_name="", digests=False)
    assert (s.fixed_workers, s.group_name, s.digests, s.device, s.backend) == (
        [1, 2],
        "weight_sync_group",
        False,
        torch.device("cpu"),
        "gloo",
    )
    with pytest.raises(TypeError, match="fixed_workers"):
        client_settings(["a:1"], fixed_workers=[1])
    with pytest.raises(ValueError, match="ramp_bytes"):
        client_settings(["a:1"], ramp_bytes=-1)
    with pytest.raises(ValueError, match="timeouts must be positive"):
        client_settings(["a:1"], group_timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        client_settings(["a:1"], workers=[0])


@pytest.mark.timeout(300)
def test_the_client_attributes_type_check_as_declared(tmp_path: Path) -> None:
    """mypy (the project's configuration) sees each public attribute with its declared type."""
    snippet = tmp_path / "uses_settings.py"
    snippet.write_text(
        "from typing import assert_type\n"
        "import torch\n"
        "from wsync_grpc.trainer import TrainerClient\n"
        "c = TrainerClient(['127.0.0.1:1'], rpc_timeout_s=5.0, device='cpu')\n"
        "assert_type(c.rpc_timeout_s, float)\n"
        "assert_type(c.bucket_bytes, int)\n"
        "assert_type(c.master_port, int | None)\n"
        "assert_type(c.device, torch.device)\n"
        "c.rpc_timeout_s = 2.0\n"
    )
    out, err, status = mypy_api.run(["--no-error-summary", str(snippet)])
    assert status == 0, out + err
    bad = tmp_path / "bad.py"
    bad.write_text("from wsync_grpc.trainer import TrainerClient\nTrainerClient(['x']).rpc_timeout_s = 'soon'\n")
    out, _, status = mypy_api.run(["--no-error-summary", str(bad)])
    assert status == 1 and "Incompatible types in assignment" in out, out
