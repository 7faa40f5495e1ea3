"""Renamed KVTierConfig fields: the old names keep working for one release wherever a config is
built from names, each with a DeprecationWarning that names the new field and points at the
caller's line; the values land in the new fields."""
import dataclasses
import warnings

import pytest

from kvtier.commands.cli import build_parser
from kvtier.config import KVTierConfig
from kvtier.configcheck import RENAMED_FIELDS

OLD_VALUES = {"hot_tokens": 128, "hot_bytes": 1 << 20, "hot_max_bytes": 1 << 30, "lz4_min_saving": 0.2}


def test_every_old_name_is_accepted_by_the_constructor_with_a_warning_naming_the_new_field():
    assert set(OLD_VALUES) == set(RENAMED_FIELDS)
    for old, value in OLD_VALUES.items():
        new = RENAMED_FIELDS[old]
        with pytest.warns(DeprecationWarning, match=f"'{old}' is renamed '{new}'") as rec:
            cfg = KVTierConfig(**{old: value})
        assert getattr(cfg, new) == value
        assert rec[0].filename == __file__  # the user's line, not kvtier's


def test_old_names_in_replace_from_dict_toml_and_presets(tmp_path):
    cfg = KVTierConfig(device_tokens=256)
    with pytest.warns(DeprecationWarning, match="'hot_tokens' is renamed 'device_tokens'"):
        assert dataclasses.replace(cfg, hot_tokens=64).device_tokens == 64
    with pytest.warns(DeprecationWarning, match="'lz4_min_saving' is renamed 'byte_stage_min_saving'"):
        assert KVTierConfig.from_dict({"lz4_min_saving": 0.1}).byte_stage_min_saving == 0.1
    path = tmp_path / "old.toml"
    path.write_text("[kvtier]\nhot_tokens = 192\nblock_tokens = 64\n")
    with pytest.warns(DeprecationWarning, match="'hot_tokens' is renamed 'device_tokens'"):
        assert KVTierConfig.from_toml(path).device_tokens == 192
    with pytest.warns(DeprecationWarning, match="'hot_tokens' is renamed 'device_tokens'"):
        assert KVTierConfig.preset("offload", hot_tokens=128).device_tokens == 128
    with pytest.raises(ValueError, match="device_tokens must be >= block_tokens"), \
            pytest.warns(DeprecationWarning):
        KVTierConfig(hot_tokens=16, block_tokens=64)  # checked under the new name


def test_new_names_warn_nothing_and_round_trip():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = KVTierConfig(device_tokens=256, device_max_bytes=1 << 30, byte_stage_min_saving=0.1)
        assert KVTierConfig.from_dict(cfg.to_dict()) == cfg
    assert not set(cfg.to_dict()) & set(RENAMED_FIELDS)


def test_old_cli_flag_is_accepted_with_a_warning():
    from kvtier.commands.generate import _config

    args = build_parser().parse_args(["generate", "--hot-tokens", "128"])
    with pytest.warns(DeprecationWarning, match="'hot_tokens' is renamed 'device_tokens'"):
        assert _config(args, None).device_tokens == 128
    args = build_parser().parse_args(["generate", "--device-tokens", "4k"])
    assert _config(args, None).device_tokens == 4096
