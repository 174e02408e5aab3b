"""``python -m fairseq_plugin`` prints the directory to pass to fairseq's ``--user-dir``."""

import os
import sys


def main() -> int:
    print(os.path.dirname(os.path.abspath(__file__)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
