import sys

from tritonllm.cli import main

sys.exit(main())
