# Sourced by run_on_device.sh: `source experiments/benchmarks/gpu_wheels.sh; install_wheels [pgx svgwrite]`.
# The GPU image lacks open_spiel, gymnasium and their dependencies: they come as wheels in .whl_env (carried with
# the call, built per the README of the device tool) and install into /tmp/site, put on PYTHONPATH.
install_wheels() {
  python3 -m pip install -q --no-index --find-links .whl_env --no-deps --no-compile --no-cache-dir --target /tmp/site \
    open_spiel gymnasium farama-notifications ml_collections cloudpickle "$@" 2>/dev/null \
    || { echo "install_wheels: the wheels in .whl_env did not install (carry .whl_env)" >&2; exit 1; }
  export PYTHONPATH=/tmp/site
}
