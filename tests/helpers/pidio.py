"""What the helper processes share: files written atomically (the tests poll for them)."""
import os


def write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_pid_file(path: str) -> None:
    write_atomic(path, str(os.getpid()))
