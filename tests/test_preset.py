"""Training presets that extend another (`"base"`): sections merge key by key, chains resolve, loops are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from train import distill
from train.preset import PRESET_DIR, read_preset
from train.set_recipe import SetSpec


def write(path, **raw):
    path.write_text(json.dumps(raw))
    return path


def test_a_preset_extends_its_base_section_by_section(tmp_path):
    write(tmp_path / "leg1.json", comment="leg 1", drafter={"num_layers": 2, "draft_vocab": 64},
          train={"steps": 100, "batch_size": 4})
    write(tmp_path / "leg2.json", base="leg1.json", train={"steps": 50})
    write(tmp_path / "leg3.json", base="leg2.json", comment="leg 3", optim={"lr": 1e-4})
    _, raw = read_preset("drafter", str(tmp_path / "leg3.json"))
    assert raw == {"comment": "leg 3", "drafter": {"num_layers": 2, "draft_vocab": 64},
                   "train": {"steps": 50, "batch_size": 4}, "optim": {"lr": 1e-4}}
    settings = distill.load_preset(str(tmp_path / "leg3.json"))
    assert (settings.train.steps, settings.train.batch_size, settings.optim.lr) == (50, 4, 1e-4)
    assert settings.drafter == distill.load_preset(str(tmp_path / "leg1.json")).drafter


def test_the_shipped_drafter_legs_keep_leg_1s_drafter_and_data(tmp_path):
    """--init-drafter refuses a leg whose drafter settings differ from the drafter it starts from, but for more
    layers (it grows): along the set's chain only num_layers may change, and only upwards."""
    spec = SetSpec.read("smollm2")
    leg1 = distill.load_preset(spec.drafter_preset)
    legs = spec.drafter_legs  # in the chain's order
    shipped = {p.stem.removeprefix("drafter_") for p in PRESET_DIR.glob("drafter_smollm2_leg*.json")}
    assert legs and set(legs) <= shipped, (legs, shipped)
    layers = leg1.drafter.num_layers
    for name in legs:
        leg = distill.load_preset(name)
        assert leg.drafter.num_layers >= layers, name
        layers = leg.drafter.num_layers
        assert (dataclasses.replace(leg.drafter, num_layers=leg1.drafter.num_layers), leg.data) == \
            (leg1.drafter, leg1.data), name
        assert dataclasses.replace(leg, drafter=leg1.drafter, train=leg1.train, optim=leg1.optim) == leg1


@pytest.mark.parametrize("base, message", [
    ("loop.json", "leads back to itself"),
    (7, "'base' names the preset this one extends"),
    ("nosuchpreset", r"other.json: its .base.: no drafter preset .nosuchpreset."),
])
def test_a_bad_base_is_refused_with_what_to_fix(tmp_path, base, message):
    write(tmp_path / "loop.json", base="other.json", train={"steps": 1})
    write(tmp_path / "other.json", base=base)
    with pytest.raises(ValueError, match=message):
        read_preset("drafter", str(tmp_path / "other.json"))
