"""What tests of processes share: whether a process still runs."""


def running(pid: int) -> bool:
    """Whether process `pid` runs (exists, and is not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
