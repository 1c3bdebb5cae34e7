"""The parity report: `tests/test_parity.py` records each case's largest differences here and
`tests/conftest.py` writes them to ``parity-report.md`` at the end of the session."""

REPORT: dict[str, dict] = {}      # case name -> the case's ParityReport dict


def record_parity(report: dict) -> None:
    REPORT[report["name"]] = report
