"""A generated ``/sys`` for simulated nodes: the InfiniBand part, laid out like the kernel's.

As on a real node, ``class/infiniband/mlx5_N`` is a relative symlink into the PCI device tree
(``devices/pci…/0000:BB:00.0/infiniband/mlx5_N``), and each port has its attributes, ``counters/``
(the PortCounters group with extended width, as ConnectX HCAs advertise) and the mlx5 driver's
``hw_counters/``. ``advance`` moves the traffic counters forward by wall time at a steady, jittered
share of the line rate. The fault hooks script what the collector and diagnosis must catch.

A value is rewritten in place, as a real sysfs attribute reads a new value from the same inode: the infiniband
collector's kept-open files are re-read as on a real node, not reopened (a file replaced by a new inode each round
cost the collector ~1 ms a round that no real node pays). The agent advances the tree before its collectors run,
never while they read, so none reads half a value. Unchanged files are not rewritten.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

from gpuwatch.agent.collectors.infiniband import (
    ACTIVE,
    EXTENDED_COUNTERS,
    IETF_COUNTERS,
    PHYS_STATES,
    PORT_COUNTER_BITS,
    PORT_STATES,
    parse_rate,
)
from gpuwatch.agent.simulate import Preset

_MARKER = ".gpuwatch-simulated-sysfs"
_MTU = 4096
#: NCCL's IB transport moves data in RDMA writes of up to 512 KiB.
_RDMA_WRITE_BYTES = 512 * 1024
#: What a down port reports as its rate on mlx5: the lowest width and speed.
_DOWN_RATE = "10 Gb/sec (4X SDR)"
_PORT_STATE_IDS = {name: number for number, name in PORT_STATES.items()}
_PHYS_STATE_IDS = {name: number for number, name in PHYS_STATES.items()}

#: (hca_type, fw_ver, board_id) by link layer or IB speed: ConnectX-6 Dx, -7, -6, -5.
_HCAS = {
    "Ethernet": ("MT4125", "22.39.2048", "MT_0000000359"),
    "NDR": ("MT4129", "28.39.2048", "MT_0000000838"),
    "HDR": ("MT4123", "20.39.2048", "MT_0000000223"),
    "EDR": ("MT4119", "16.35.3006", "MT_0000000008"),
}
_HW_COUNTERS = (
    "duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "out_of_buffer", "out_of_sequence",
    "packet_seq_err", "req_cqe_error", "req_cqe_flush_error", "req_remote_access_errors",
    "req_remote_invalid_request", "resp_cqe_error", "resp_cqe_flush_error", "resp_local_length_error",
    "resp_remote_access_errors", "rnr_nak_retry_err", "roce_adp_retrans", "roce_adp_retrans_to",
    "roce_slow_restart", "roce_slow_restart_cnps", "roce_slow_restart_trans", "rx_atomic_requests",
    "rx_dct_connect", "rx_read_requests", "rx_write_requests",
)
#: RoCE congestion control (DCQCN) and ICRC counters, only on Ethernet ports.
_ROCE_HW_COUNTERS = ("np_cnp_sent", "np_ecn_marked_roce_packets", "rp_cnp_handled", "rp_cnp_ignored",
                     "rx_icrc_encapsulated")


class _Port:
    """One port's state and counter values; files are keyed by their path under the port directory."""

    def __init__(self, path: Path, rate: str, load: float) -> None:
        self.path = path
        self.rate = rate
        self.line_rate = parse_rate(rate)
        self.load = load
        self.up = True
        self.phys_state_down = _PHYS_STATE_IDS["Disabled"]
        self.extended = True
        self.values: dict[str, int] = {}
        self.unavailable: set[str] = set()

    def bits(self, key: str) -> int:
        group, _, name = key.partition("/")
        if group != "counters" or (self.extended and name in EXTENDED_COUNTERS):
            return 64
        return PORT_COUNTER_BITS.get(name, 64)

    def add(self, key: str, amount: float) -> None:
        """Counters saturate at their width, as the IB PortCounters do, instead of wrapping."""
        self.values[key] = min(self.values[key] + int(amount), (1 << self.bits(key)) - 1)


class SimulatedSysfs:
    """The sysfs tree of one preset under ``root`` (plays ``/sys``), advanced before each sampling round."""

    def __init__(self, preset: Preset, root: Path, seed: int = 0) -> None:
        self.preset = preset
        self.root = Path(root)
        self._rng = random.Random(seed)
        self._prepare_root()
        self._written: dict[str, str] = {}  # path -> text, so that unchanged files are not rewritten
        self._ports: dict[tuple[str, int], _Port] = {}
        self._device_dirs: dict[str, Path] = {}
        for index in range(preset.ib_ports):
            self._create_device(index)
        self._last = time.monotonic()

    def _prepare_root(self) -> None:
        """Regenerate a tree this class made before; never overwrite anything else."""
        if self.root.exists() and any(self.root.iterdir()):
            if not (self.root / _MARKER).exists():
                raise FileExistsError(f"{self.root} is not empty and not a simulated sysfs tree")
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / _MARKER).touch()

    # -- building the tree ---------------------------------------------------------------------

    def _create_device(self, index: int) -> None:
        preset, rng = self.preset, self._rng
        device = f"mlx5_{index}"
        bus = 0x18 + 0x1A * index
        pci = f"0000:{bus:02x}:00.0"
        bridge = f"pci0000:{bus - 1:02x}/0000:{bus - 1:02x}:01.0"
        device_dir = self.root / "devices" / bridge / pci / "infiniband" / device
        class_dir = self.root / "class" / "infiniband"
        class_dir.mkdir(parents=True, exist_ok=True)
        device_dir.mkdir(parents=True)
        (class_dir / device).symlink_to(os.path.relpath(device_dir, class_dir))
        (device_dir / "device").symlink_to(f"../../../{pci}")
        self._device_dirs[device] = device_dir

        ethernet = preset.ib_link_layer == "Ethernet"
        hca_type, fw_ver, board_id = _HCAS["Ethernet" if ethernet else preset.ib_rate.split()[-1].rstrip(")")]
        guid = f"b83f:d203:00{rng.randrange(256):02x}:{index:04x}"
        for name, text in (("board_id", board_id), ("fw_ver", fw_ver), ("hca_type", hca_type),
                           ("node_guid", guid), ("sys_image_guid", guid), ("node_type", "1: CA"),
                           ("node_desc", f"gpuwatch-sim {device}")):
            self._write(f"{device_dir}/{name}", text)

        port = _Port(device_dir / "ports" / "1", preset.ib_rate, load=rng.uniform(0.35, 0.7))
        for sub in ("counters", "hw_counters"):
            (port.path / sub).mkdir(parents=True)
        for name, text in (("lid", "0x0" if ethernet else f"0x{index + 0x1A:x}"),
                           ("sm_lid", "0x0" if ethernet else "0x1"), ("sm_sl", "0"), ("lid_mask_count", "0"),
                           ("cap_mask", "0x00010000" if ethernet else "0xa751e848"),
                           ("link_layer", preset.ib_link_layer), ("hw_counters/lifespan", "10")):
            self._write(f"{port.path}/{name}", text)
        self._seed_counters(port, ethernet)
        self._ports[(device, 1)] = port
        self._write_port(port)

    def _seed_counters(self, port: _Port, ethernet: bool) -> None:
        """Plausible totals for a node that has been training for a while."""
        rng = self._rng
        for name in (*PORT_COUNTER_BITS, *IETF_COUNTERS):
            port.values[f"counters/{name}"] = 0
        for direction in ("xmit", "rcv"):
            words = rng.randrange(10**11, 10**12)
            packets = words * 4 // _MTU
            port.values[f"counters/port_{direction}_data"] = words
            port.values[f"counters/port_{direction}_packets"] = packets
            port.values[f"counters/unicast_{direction}_packets"] = packets
            port.values[f"counters/multicast_{direction}_packets"] = rng.randrange(100, 1000)
        port.values["counters/port_xmit_wait"] = rng.randrange(10**5, 10**6)
        for name in (*_HW_COUNTERS, *(_ROCE_HW_COUNTERS if ethernet else ())):
            port.values[f"hw_counters/{name}"] = 0
        received_bytes = port.values["counters/port_rcv_data"] * 4
        port.values["hw_counters/rx_write_requests"] = received_bytes // _RDMA_WRITE_BYTES
        port.values["hw_counters/rx_read_requests"] = rng.randrange(10**3, 10**4)

    # -- writing -------------------------------------------------------------------------------

    def _write(self, path: str, text: str) -> None:
        """Paths are strings: pathlib's joins and hashes cost more than the ~430 writes a round checks. Written
        without truncating first, then cut to length, so the file is never empty (counters only grow longer)."""
        previous = self._written.get(path)
        if previous == text:
            return
        data = f"{text}\n".encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.pwrite(fd, data, 0)
            if previous is not None and len(previous) > len(text):
                os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
        self._written[path] = text

    def _write_port(self, port: _Port) -> None:
        if port.up:
            state, phys_state, rate = ACTIVE, _PHYS_STATE_IDS["LinkUp"], port.rate
        else:
            state, phys_state, rate = _PORT_STATE_IDS["DOWN"], port.phys_state_down, _DOWN_RATE
        self._write(f"{port.path}/state", f"{state}: {PORT_STATES[state]}")
        self._write(f"{port.path}/phys_state", f"{phys_state}: {PHYS_STATES[phys_state]}")
        self._write(f"{port.path}/rate", rate)
        for key, value in port.values.items():
            self._write(f"{port.path}/{key}", "N/A (no PMA)" if key in port.unavailable else str(value))

    # -- time ----------------------------------------------------------------------------------

    def advance(self, seconds: float | None = None) -> None:
        """Move traffic forward by ``seconds``, or by the wall time since the last call."""
        now = time.monotonic()
        elapsed = now - self._last if seconds is None else seconds
        self._last = now
        for port in self._ports.values():
            if port.up:
                self._traffic(port, elapsed)
            self._write_port(port)

    def _traffic(self, port: _Port, seconds: float) -> None:
        rng = self._rng
        load = min(1.0, port.load * rng.uniform(0.9, 1.1))
        for direction in ("xmit", "rcv"):
            data = port.line_rate * load * rng.uniform(0.97, 1.03) * seconds
            port.add(f"counters/port_{direction}_data", data / 4)
            port.add(f"counters/port_{direction}_packets", data / _MTU)
            if port.extended:
                port.add(f"counters/unicast_{direction}_packets", data / _MTU)
                port.add(f"counters/multicast_{direction}_packets", 1 if rng.random() < seconds else 0)
        # Ticks without credits: rare at low load, steep near line rate.
        port.add("counters/port_xmit_wait", load**4 * 5e4 * seconds)
        port.add("hw_counters/rx_write_requests", port.line_rate * load * seconds / _RDMA_WRITE_BYTES)
        if "hw_counters/np_cnp_sent" in port.values:
            congestion = load**2 * 2e3 * seconds
            port.add("hw_counters/np_cnp_sent", congestion)
            port.add("hw_counters/np_ecn_marked_roce_packets", congestion)
            port.add("hw_counters/rp_cnp_handled", congestion)

    # -- fault hooks ---------------------------------------------------------------------------

    def _port(self, device: str, port: int) -> _Port:
        try:
            return self._ports[(device, port)]
        except KeyError:
            raise KeyError(f"no simulated port {device}/{port}") from None

    def set_port_down(self, device: str, *, port: int = 1, phys_state: str = "Disabled") -> None:
        """Take a link down (``"Polling"``: cable or peer gone; ``"Disabled"``: administratively).

        Like the hardware, LinkDownedCounter counts the transition from LinkUp.
        """
        target = self._port(device, port)
        if target.up:
            target.add("counters/link_downed", 1)
        target.up = False
        target.phys_state_down = _PHYS_STATE_IDS[phys_state]
        self._write_port(target)

    def set_port_up(self, device: str, *, port: int = 1) -> None:
        target = self._port(device, port)
        target.up = True
        self._write_port(target)

    def _counter(self, device: str, counter: str, port: int) -> tuple[_Port, str]:
        """The port and the key of a ``counters/`` or ``hw_counters/`` file, by file name."""
        target = self._port(device, port)
        for key in (f"counters/{counter}", f"hw_counters/{counter}"):
            if key in target.values:
                return target, key
        raise KeyError(f"{device}/{port} has no counter {counter}")

    def bump_counter(self, device: str, counter: str, by: int = 1, *, port: int = 1) -> None:
        """Add to a counter (an error burst); fixed-width ones saturate."""
        target, key = self._counter(device, counter, port)
        target.add(key, by)
        self._write_port(target)

    def make_unavailable(self, device: str, counter: str, *, port: int = 1) -> None:
        """Make a counter read ``N/A (no PMA)``, as on HCAs without a performance management agent."""
        target, key = self._counter(device, counter, port)
        target.unavailable.add(key)
        self._write_port(target)

    def use_32bit_counters(self, device: str, *, port: int = 1) -> None:
        """Switch a port to the kernel's plain PortCounters group, as on an HCA without extended width.

        The ``unicast_*``/``multicast_*`` files disappear and the data and packet counters become
        32-bit: on any busy port they are already stuck at 2^32-1.
        """
        target = self._port(device, port)
        target.extended = False
        for name in IETF_COUNTERS:
            key = f"counters/{name}"
            del target.values[key]
            (target.path / key).unlink()
            self._written.pop(f"{target.path}/{key}", None)
        for key in target.values:
            target.add(key, 0)  # clamp to the new widths
        self._write_port(target)

    def remove_device(self, device: str) -> None:
        """Hot-unplug / driver unbind: the class link and the device directory vanish."""
        device_dir = self._device_dirs.pop(device)
        (self.root / "class" / "infiniband" / device).unlink()
        shutil.rmtree(device_dir)
        for key in [key for key in self._ports if key[0] == device]:
            del self._ports[key]
        self._written = {path: text for path, text in self._written.items()
                         if not path.startswith(f"{device_dir}/")}
