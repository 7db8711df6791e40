"""The SoftTopk ``t`` schedule: values, state-dict round trip, resume."""

from __future__ import annotations

import io
import math

import pytest
import torch

from maxscore.routing.config import TemperatureScheduleConfig
from maxscore.routing.schedule import TemperatureSchedule


def at(schedule: TemperatureSchedule, step: int) -> float:
    schedule.step.fill_(step)
    return float(schedule.value())


def test_default_reproduces_authors_factor_4_to_1() -> None:
    s = TemperatureSchedule()
    # k = 2: second expert's factor is 1 + t: 4 at the start, 1 after 30,000 steps
    assert at(s, 0) == pytest.approx(3.0)
    assert at(s, 15_000) == pytest.approx(1.5)
    assert at(s, 30_000) == pytest.approx(0.0)
    assert at(s, 90_000) == pytest.approx(0.0)  # stays at the end value


def test_linear_cosine_constant() -> None:
    lin = TemperatureSchedule(TemperatureScheduleConfig(start=4.0, end=1.0, steps=100))
    assert at(lin, 25) == pytest.approx(3.25)
    cos = TemperatureSchedule(
        TemperatureScheduleConfig(start=4.0, end=1.0, steps=100, shape="cosine")
    )
    assert at(cos, 0) == pytest.approx(4.0)
    assert at(cos, 50) == pytest.approx(2.5)
    assert at(cos, 25) == pytest.approx(1.0 + 1.5 * (1.0 + math.sqrt(0.5)), rel=1e-6)
    assert at(cos, 100) == pytest.approx(1.0)
    assert at(cos, 1000) == pytest.approx(1.0)
    const = TemperatureSchedule(TemperatureScheduleConfig(start=2.0, shape="constant"))
    assert at(const, 0) == at(const, 10**6) == pytest.approx(2.0)
    zero = TemperatureSchedule(TemperatureScheduleConfig(start=2.0, end=0.5, steps=0))
    assert at(zero, 0) == pytest.approx(0.5)


def test_value_is_0dim_fp32_tensor_and_advance_in_place() -> None:
    s = TemperatureSchedule(TemperatureScheduleConfig(start=3.0, end=0.0, steps=10))
    buf = s.step
    v = s.value()
    assert isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == torch.float32
    s.advance()
    s.advance(4)
    assert s.step is buf and s.step.dtype == torch.long and int(s.step) == 5
    assert float(s.value()) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="negative"):
        s.advance(-1)


def test_state_dict_round_trip_and_resume() -> None:
    cfg = TemperatureScheduleConfig(start=3.0, end=0.0, steps=100)
    s = TemperatureSchedule(cfg)
    s.advance(40)
    assert "step" in s.state_dict()
    buffer = io.BytesIO()
    torch.save(s.state_dict(), buffer)
    buffer.seek(0)
    resumed = TemperatureSchedule(cfg)
    assert int(resumed.step) == 0
    resumed.load_state_dict(torch.load(buffer))
    assert int(resumed.step) == 40
    assert float(resumed.value()) == pytest.approx(float(s.value()))
    resumed.advance(10)  # training goes on from where it stopped
    assert float(resumed.value()) == pytest.approx(1.5)


def test_step_survives_dtype_cast() -> None:
    s = TemperatureSchedule()
    s.advance(7)
    s.to(torch.bfloat16)
    assert s.step.dtype == torch.long and int(s.step) == 7


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="steps"):
        TemperatureScheduleConfig(steps=-1)
    with pytest.raises(ValueError, match="shape"):
        TemperatureScheduleConfig(shape="exp")  # type: ignore[arg-type]
