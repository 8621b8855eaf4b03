import pytest

from sglang_adatree.config import SETTINGS, AdaTreeConfig, ConfigError, load_config
from sglang_adatree.core.shapes import NO_SPEC, TreeShape


def test_defaults_validate():
    cfg = load_config(env={})
    assert cfg == AdaTreeConfig()
    assert cfg.resolved_db_url.startswith("sqlite:///")
    assert cfg.resolved_db_url.endswith("adatree.sqlite")


def test_precedence_file_env_code(tmp_path):
    path = tmp_path / "adatree.toml"
    path.write_text('[adatree]\nmin_gain = 0.2\nwarmup_steps = 5\ncandidate_shapes = "0;3,1,4"\n')
    cfg = load_config(path, env={"ADATREE_WARMUP_STEPS": "7"}, explore_fraction=0.1)
    assert cfg.min_gain == 0.2
    assert cfg.warmup_steps == 7
    assert cfg.explore_fraction == 0.1
    assert cfg.candidate_shapes == (NO_SPEC, TreeShape(3, 1, 4))


def test_config_env_names_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("candidate_shapes = ['0', '2,2,4', [3, 1, 4]]\n")
    cfg = load_config(env={"ADATREE_CONFIG": str(path), "ADATREE_HOME": str(tmp_path)})
    assert TreeShape(2, 2, 4) in cfg.candidate_shapes
    assert cfg.home_dir == tmp_path
    assert cfg.resolved_db_url == f"sqlite:///{tmp_path / 'adatree.sqlite'}"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("min_gain", 2.0, r"min_gain = 2.0 .*allowed \[0, 1\]"),
        ("warmup_steps", -1, r"warmup_steps .*allowed \[0, 100000\]"),
        ("warmup_steps", 1.5, "warmup_steps"),
        ("candidate_shapes", "3,1,9", "chain"),
        ("candidate_shapes", "0", "no speculative shape"),
        ("policy", "magic", "policy"),
        ("record_steps", "maybe", "record_steps"),
        ("nonsense", 1, "unknown setting 'nonsense'"),
    ],
)
def test_bad_values_name_key_and_range(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, **{key: value})


def test_bad_env_value_names_variable():
    with pytest.raises(ConfigError, match="ADATREE_MIN_GAIN"):
        load_config(env={"ADATREE_MIN_GAIN": "abc"})


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("min_gain = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, env={})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("colour = 'red'\n")
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        load_config(unknown, env={})


def test_frozen_and_replace():
    cfg = AdaTreeConfig()
    with pytest.raises(AttributeError):
        cfg.min_gain = 0.5  # type: ignore[misc]
    assert cfg.replace(min_gain="0.5").min_gain == 0.5
    with pytest.raises(ConfigError):
        cfg.replace(min_gain=5)


def test_to_dict_covers_every_setting():
    d = AdaTreeConfig().to_dict()
    assert set(d) == {s.name for s in SETTINGS}
    assert d["candidate_shapes"][0] == "0,1,1"


def test_every_setting_is_documented():
    from pathlib import Path

    usage = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    for setting in SETTINGS:
        assert f"| `{setting.name}` | `ADATREE_{setting.name.upper()}` |" in usage, setting.name


def test_one_field_per_setting_with_its_default():
    import dataclasses

    fields = dataclasses.fields(AdaTreeConfig)
    assert [f.name for f in fields] == [s.name for s in SETTINGS]
    assert all(f.default == s.default for f, s in zip(fields, SETTINGS, strict=True))


def test_settings_removed_are_refused():
    # A setting no code read is gone; asking for it names the known ones.
    with pytest.raises(ConfigError, match="unknown setting 'objective'"):
        load_config(env={}, objective="goodput")
