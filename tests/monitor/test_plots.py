"""Plots: the drawn data equals the metrics."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")

from jacflow.monitor import (
    cosine_similarities,
    plot_cosine_matrix,
    plot_cosines_over_training,
    plot_curves,
)


def test_cosine_matrix_image_holds_the_cosines() -> None:
    J = torch.randn(4, 5, dtype=torch.float64)
    figure = plot_cosine_matrix(J @ J.T, list("abcd"))
    image = figure.axes[0].get_images()[0].get_array()
    assert torch.allclose(torch.as_tensor(image), cosine_similarities(J @ J.T))


def test_curves_and_training_heatmap() -> None:
    history = [
        {"step": float(s), "loss/a": 1.0 / (s + 1), "cos/a-b": -1.0 + s / 5} for s in range(10)
    ]
    lines = plot_curves(history, "loss/").axes[0].get_lines()
    assert list(lines[0].get_ydata()) == [1.0 / (s + 1) for s in range(10)]
    image = plot_cosines_over_training(history, max_columns=5).axes[0].get_images()[0]
    # 10 steps in 5 bins: each bin averages two consecutive steps
    expected = [(-1.0 + s / 5 + -1.0 + (s + 1) / 5) / 2 for s in range(0, 10, 2)]
    assert list(image.get_array()[0]) == pytest.approx(expected)
    with pytest.raises(ValueError, match="No metric starts with 'weight/'"):
        plot_curves(history, "weight/")


def test_missing_matplotlib_gives_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r'pip install "jacflow\[plot\]"'):
        plot_cosine_matrix(torch.eye(2))


def test_smoothing_is_a_trailing_mean() -> None:
    history = [{"step": float(s), "w/a": float(s * s)} for s in range(6)]
    ydata = list(plot_curves(history, "w/", smooth=3).axes[0].get_lines()[0].get_ydata())
    values = [float(s * s) for s in range(6)]
    expected = [sum(values[max(0, i - 2) : i + 1]) / min(i + 1, 3) for i in range(6)]
    assert ydata == pytest.approx(expected)
    with pytest.raises(ValueError, match="`smooth` must be a positive int"):
        plot_curves(history, "w/", smooth=0)


def test_cosine_matrix_of_a_bfloat16_gramian() -> None:
    # J = [[1, 0], [-1, 1]]: cos = -1 / sqrt(2) by hand (bfloat16 keeps about 3 digits)
    gramian = torch.tensor([[1.0, -1.0], [-1.0, 2.0]], dtype=torch.bfloat16)
    image = plot_cosine_matrix(gramian).axes[0].images[0].get_array()
    assert float(image[0, 1]) == pytest.approx(-(0.5**0.5), abs=1e-2)


def test_plot_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="`names` must have 2 entries"):
        plot_cosine_matrix(torch.eye(2), ["a", "b", "c"])
    history = [{"step": 0.0, "cos/a-b": 0.5}]
    with pytest.raises(TypeError, match="`max_columns` must be an int"):
        plot_cosines_over_training(history, max_columns=2.5)  # type: ignore[arg-type]
