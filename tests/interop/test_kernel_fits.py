"""The 16-bit soft-capping's rational tanh (rough_tanh in kernels/cpu/cpu_kernels.cc) is the fit
scripts/fit_rough_tanh.py makes: the script, run here, prints the coefficients the kernel holds, and an fp32 error
below a millionth."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rough_tanh_holds_the_fit_the_script_makes():
    out = subprocess.run([sys.executable, ROOT / "scripts" / "fit_rough_tanh.py"], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    fitted = {name: [float(v) for v in re.findall(r"([-0-9.e]+)f", line)]
              for name, line in re.findall(r"^(P|Q) \(s\^0 .. s\^\d\): (.*)$", out, re.M)}
    assert len(fitted["P"]) == 5 and len(fitted["Q"]) == 4, out
    assert float(re.search(r"largest relative error in fp32 over \[-12, 12\]: (\S+)", out).group(1)) < 1e-6, out
    source = (ROOT / "kernels" / "cpu" / "cpu_kernels.cc").read_text()
    body = source[source.index("Vec rough_tanh(const Vec& x) {"):]
    body = body[:body.index("\n}\n")]
    held = [float(v) for v in re.findall(r"(-?[0-9.]+(?:e-?[0-9]+)?)f\b", body)]
    # The kernel's constants: the clamp (±9.02), then P's and Q's highest terms, then the rest of P and of Q by Horner
    # (Q's constant 1 last).
    p, q = fitted["P"], fitted["Q"]
    assert held == [-9.02, 9.02, p[4], q[3], p[3], p[2], p[1], p[0], q[2], q[1], q[0]], (held, fitted)
