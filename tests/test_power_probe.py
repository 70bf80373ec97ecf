"""benchmarks/power_probe.py's reading of nvidia-smi samples and their split into phases, on
synthetic samples (running the probe needs GPUs and nvidia-smi)."""
import datetime
import pathlib

from conftest import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "power_probe.py"


def _line(t: float, gpu: int, mhz: float, watts: float, reasons: str) -> str:
  stamp = datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
  return f"{stamp}, {gpu}, {mhz}, {watts}, {reasons}"


def test_samples_are_split_into_phases_per_gpu():
  probe = load_script(SCRIPT, "power_probe")
  t0 = 1_800_000_000.0
  lines = ["timestamp, index, clocks.sm [MHz], power.draw [W], clocks_event_reasons.active",
           _line(t0 + 0.1, 0, 1980, 300, "0x0000000000000000"),   # phase a's first 0.3 s: out
           _line(t0 + 0.5, 0, 1830, 690, "0x0000000000000004"),
           _line(t0 + 0.6, 0, 1800, 700, "0x0000000000000004"),
           _line(t0 + 0.7, 0, 1890, 650, "0x0000000000000000"),
           _line(t0 + 0.5, 1, 1700, 600, "0x0000000000000004"),
           _line(t0 + 2.5, 0, 1500, 710, "0x0000000000000004"),   # phase b
           "[N/A], 0, 1, 1, x"]
  samples = probe.parse_samples("\n".join(lines))
  assert len(samples) == 6 and samples[1]["gpu"] == 0 and samples[1]["sm_mhz"] == 1830
  summary = probe.summarize(samples, {"a": (t0, t0 + 1.0), "b": (t0 + 2.0, t0 + 3.0)})
  assert summary["a"]["0"] == {"samples": 3, "sm_mhz_median": 1830, "power_w_mean": 680.0,
                               "reasons": ["0x0000000000000000", "0x0000000000000004"]}
  assert summary["a"]["1"]["samples"] == 1
  assert summary["b"] == {"0": {"samples": 1, "sm_mhz_median": 1500, "power_w_mean": 710.0,
                                "reasons": ["0x0000000000000004"]}}


def test_sampler_output_past_a_pipe_buffer_is_kept():
  """The sampler writes far more than a pipe holds (64 KiB) before the work ends; its later
  lines must still be there (they were lost when the output went to an unread pipe)."""
  import sys
  import time

  probe = load_script(SCRIPT, "power_probe")
  writer = ("import sys, time\n"
            "for i in range(4000): print('%05d' % i + 'x' * 60)\n"
            "print('late sample', flush=True)\n"
            "time.sleep(60)\n")
  result, text = probe.sample_while([sys.executable, "-c", writer],
                                    lambda: time.sleep(2.0) or "done")
  assert result == "done"
  assert text.count("\n") >= 4000 and "late sample" in text


def test_energy_per_call_is_mean_power_times_time_per_call():
  probe = load_script(SCRIPT, "power_probe")
  phases = {"gemm": {"0": {"power_w_mean": 620.0}, "1": {"power_w_mean": 610.0}},
            "jaxflux": {"0": {"power_w_mean": 615.0}}}
  energy = probe.energy_per_call(phases, {"gemm": 2.0, "jaxflux": 2.2})
  assert energy == {"gemm": {"0": 1240.0, "1": 1220.0}, "jaxflux": {"0": 1353.0}}


def test_cycles_per_call_is_time_per_call_times_median_clock():
  probe = load_script(SCRIPT, "power_probe")
  phases = {"gemm": {"0": {"sm_mhz_median": 1500.0}}, "jaxflux": {"0": {"sm_mhz_median": 1400.0}}}
  cycles = probe.cycles_per_call(phases, {"gemm": 2.8, "jaxflux": 3.0})
  assert cycles == {"gemm": {"0": 4.2}, "jaxflux": {"0": 4.2}}
