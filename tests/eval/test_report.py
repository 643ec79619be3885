"""lowbit report: the page and its figures from eval JSON rows, and the page as Chromium draws it."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import torch  # noqa: E402

from lowbit.eval.distributions import ChannelMagnitudes  # noqa: E402
from lowbit.eval.layer_error import LayerError  # noqa: E402
from lowbit.eval.report import pareto_front, write_report  # noqa: E402

CHROMIUM = "/usr/bin/chromium"


def _rows():
    rows = []
    for label, method, bits, ppl, kl, kv in [
        ("fp", "fp", 16.0, 20.0, 0.0, 9216),
        ("rtn-w4", "rtn", 4.25, 22.0, 0.05, 9216),
        ("gptq-w4", "gptq", 4.25, 21.0, 0.03, 9216),
        ("rtn-w3", "rtn", 3.25, 35.0, 0.4, 9216),
        ("kivi-2", "kivi", 16.0, 20.5, 0.01, 2600),
    ]:
        rows.append(
            {"model": "tiny", "recipe": {"method": method}, "label": label, "ppl": ppl,
             "kl": kl, "bits_per_weight": bits, "kv_bytes_per_token": kv}
        )  # fmt: skip
    return rows


def _insides():
    """Measurements of the right shapes (3 blocks, 4 KV channels of heads of 2)."""
    linears = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    errors = [
        LayerError(label, [0.01 * s, 0.02 * s, 0.05 * s], {n: [0.01 * s] * 3 for n in linears})
        for label, s in (("rtn", 2.0), ("gptq", 1.0))
    ]
    magnitudes = ChannelMagnitudes(
        layer=1, activations=torch.tensor([0.5, 9.0, 0.4, 0.6]),
        activations_rotated=torch.tensor([2.0, 2.5, 2.2, 1.9]),
        keys=torch.tensor([1.0, 5.0, 4.0, 2.0]), keys_sorted=torch.tensor([5.0, 1.0, 4.0, 2.0]),
        head_dim=2,
    )  # fmt: skip
    return errors, magnitudes


def test_pareto_front_keeps_only_undominated_points():
    points = [(4.25, 22.0), (4.25, 21.0), (3.25, 35.0), (16.0, 20.5), (8.0, 30.0)]
    # (4.25, 22) loses to (4.25, 21); (8, 30) loses to (4.25, 21)
    assert pareto_front(points) == [2, 1, 3]


def test_report_writes_page_and_figure_files(tmp_path):
    results = tmp_path / "demo.json"
    results.write_text(json.dumps(_rows()))
    page = write_report([results], tmp_path / "out")
    names = {"pareto-ppl.png", "pareto-kl.png", "kv-cache.png"}
    assert {p.name for p in (tmp_path / "out").iterdir()} == names | {"index.html"}
    for name in names:
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 3
    assert 'src="http' not in text and "src='http" not in text  # self-contained


def test_report_of_measurements_alone_has_their_figures_and_no_table(tmp_path):
    errors, magnitudes = _insides()
    page = write_report([], tmp_path / "out", layer_errors=errors, magnitudes=magnitudes, model="m")
    names = {"layer-error.png", "linear-error.png", "channels.png"}
    files = {"index.html", "measurements.json"}
    assert {p.name for p in (tmp_path / "out").iterdir()} == names | files
    numbers = json.loads((tmp_path / "out" / "measurements.json").read_text())
    assert numbers["layer_error"][0]["blocks"] == errors[0].blocks
    assert numbers["channels"]["keys_sorted"] == [5.0, 1.0, 4.0, 2.0]
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 3 and "<table>" not in text
    assert "lowbit report: m" in text


def test_cli_measures_a_float_model_and_refuses_a_quantized_one(tmp_path, tiny_model_dir, capsys):
    """lowbit report --layer-error/--channels on a tiny model; a quantized model (or no input at
    all) is one sentence, exit 2, nothing written."""
    import lowbit
    from lowbit.cli import main

    out = tmp_path / "out"
    here = str(Path(__file__))
    code = main([
        "report", "--model", str(tiny_model_dir), "--out", str(out), "--layer-error", "rtn",
        "gptq", "--channels", "--seqlen", "32", "--windows", "2", "--no-progress", "--dataset",
        here, "--calib", here, "--calib-samples", "2",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-2000:]
    assert {p.name for p in out.iterdir()} == {
        "index.html",
        "measurements.json",
        "layer-error.png",
        "linear-error.png",
        "channels.png",
    }
    loaded = lowbit.load_model(str(tiny_model_dir))
    lowbit.save(lowbit.quantize(loaded.model, "rtn"), tmp_path / "q", tokenizer=loaded.tokenizer)
    capsys.readouterr()
    for bad, message in (
        ([], "nothing to report"),
        (["--layer-error", "rtn", "--model", str(tmp_path / "q")], "is already quantized"),
    ):
        assert main(["report", "--out", str(tmp_path / "o"), *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / "o").exists()


def test_cli_bad_input_is_one_sentence_and_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"ppl": 3}')
    cmd = [sys.executable, "-m", "lowbit", "report", str(bad), "--out", str(tmp_path / "o")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "not a lowbit eval --json result" in done.stderr
    assert not (tmp_path / "o").exists()


# run after load: each <img> decoded, drawn to a canvas, and its non-white pixels counted
_CHECK = """<script>
window.addEventListener('load', () => {
  const out = [];
  for (const img of document.images) {
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    let ink = 0;
    if (c.width > 0) {
      const g = c.getContext('2d'); g.drawImage(img, 0, 0);
      const d = g.getImageData(0, 0, c.width, c.height).data;
      for (let i = 0; i < d.length; i += 4) if (d[i] < 200 || d[i+1] < 200 || d[i+2] < 200) ink++;
    }
    out.push(img.id + ':' + img.naturalWidth + ':' + ink);
  }
  const pre = document.createElement('pre'); pre.id = 'check';
  pre.textContent = 'CHECK[' + out.join(',') + ']'; document.body.appendChild(pre);
});
</script>"""


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
def test_chromium_draws_every_figure(tmp_path):
    results = tmp_path / "demo.json"
    results.write_text(json.dumps(_rows()))
    errors, magnitudes = _insides()
    page = write_report([results], tmp_path / "out", layer_errors=errors, magnitudes=magnitudes)
    checked = tmp_path / "checked.html"  # the page plus the check script, beside it
    checked.write_text(page.read_text().replace("</body>", _CHECK + "</body>"))
    profile = tmp_path / "profile"
    profile.mkdir()
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom",
    ]  # fmt: skip
    done = subprocess.run(
        [CHROMIUM, *flags, checked.as_uri()], capture_output=True, text=True, timeout=120
    )
    found = re.search(r"<pre id=\"check\">CHECK\[(.*?)\]</pre>", done.stdout)
    assert found, done.stderr[-2000:]
    seen = {}
    for item in found.group(1).split(","):
        name, width, ink = item.split(":")
        seen[name] = (int(width), int(ink))
    assert set(seen) == {
        "pareto-ppl.png", "pareto-kl.png", "kv-cache.png", "layer-error.png", "linear-error.png",
        "channels.png",
    }  # fmt: skip
    for name, (width, ink) in seen.items():
        assert width > 300, name  # decoded, at its size
        # drawn: axes, text and lines (measured 7140 to 8482 such pixels; a blank PNG has 0)
        assert ink > 2000, name
    shutil.rmtree(profile, ignore_errors=True)
