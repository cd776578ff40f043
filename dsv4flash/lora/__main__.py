"""`python -m dsv4flash.lora`: the placement report (see report.py)."""

from dsv4flash.lora.report import main

raise SystemExit(main())
