"""The report commands' shared table (``services.tools.report_cmd.table``): aligned columns,
problem rows coloured only when asked."""

from __future__ import annotations

from services.tools.report_cmd import RED, RESET, table


def test_columns_are_aligned_and_only_problem_rows_coloured() -> None:
    rows = [(["10.0.0.5", "3"], ""), (["10.0.0.60", "12"], RED)]
    plain = table(("IP", "N"), rows, color=False)
    assert plain.splitlines() == ["IP         N", "10.0.0.5   3", "10.0.0.60  12"]
    coloured = table(("IP", "N"), rows, color=True).splitlines()
    assert coloured[1] == "10.0.0.5   3"
    assert coloured[2] == f"{RED}10.0.0.60  12{RESET}"
