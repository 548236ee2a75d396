"""Stand-ins for ``srun`` and ``scontrol`` that let bash run an sbatch template outside
SLURM: each ``srun`` step records its arguments (``<STEPS>/<n>.args``, one a line) and its
environment (``<STEPS>/<n>.env``) and runs nothing; ``scontrol`` names one node, node1."""

from __future__ import annotations

from pathlib import Path


def slurm_stand_ins(tmp_path: Path) -> tuple[Path, Path]:
    """The stand-ins' directory (put it first on PATH, with ``STEPS`` set to the second)
    and the directory the steps are recorded in."""
    bin_dir, steps = tmp_path / "bin", tmp_path / "steps"
    bin_dir.mkdir()
    steps.mkdir()
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        'n=$(find "$STEPS" -name "*.args" | wc -l)\n'
        'printf "%s\\n" "$@" > "$STEPS/$n.args"\n'
        'env > "$STEPS/$n.env"\n'
    )
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir, steps
