"""Upload the app to a Hugging Face Space, without what only developers need.

    python scripts/deploy_space.py --repo_id USER/chat-e --dry-run   # list the files it would upload
    python scripts/deploy_space.py --repo_id USER/chat-e             # create the Space if needed, upload

The token comes from HF_TOKEN or from `hf auth login`; it is never printed. The README's front
matter is the Space's configuration (sdk, app_file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

ROOT = Path(__file__).resolve().parent.parent

# What stays out of the Space (fnmatch patterns on paths relative to ROOT; "*" also matches "/").
# The one list both the upload and --dry-run use.
IGNORE_PATTERNS = (
    # development only: the Space runs app.py with chat/, finetune/, webui/, configs/, data/sample/
    "bench/*",
    "tests/*",
    "docs/*",
    "scripts/*",
    # written at run time (training runs, files users upload); a Space starts without them
    "runs/*",
    "data/uploads/*",
    # hidden files and folders anywhere: .git, .ci, tool caches, virtualenvs, .env secrets
    ".*",
    "*/.*",
    # Python's caches
    "*__pycache__/*",
    "*.pyc",
)


def files_to_upload(folder: Path = ROOT) -> list[str]:
    """The paths (relative, sorted) that ``upload_folder`` sends from ``folder``: listed and filtered
    the way huggingface_hub does it, with its own default ignores (.git) added to ours."""
    paths = sorted(p.relative_to(folder).as_posix() for p in folder.glob("**/*") if p.is_file())
    return list(filter_repo_objects(paths, ignore_patterns=[*IGNORE_PATTERNS, *DEFAULT_IGNORE_PATTERNS]))


def deploy(repo_id: str, folder: Path = ROOT, message: str = "Deploy persona-chat") -> str:
    """Create the Space ``repo_id`` if it does not exist, upload ``files_to_upload(folder)`` to it,
    and return the commit's URL.

    Files an earlier upload left on the Space that match IGNORE_PATTERNS (say a bench/ from before
    this script) are deleted by the same upload; huggingface_hub always keeps .gitattributes."""
    from huggingface_hub import HfApi, get_token

    if not get_token():  # HF_TOKEN, else the token `hf auth login` saved
        raise SystemExit("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
    api = HfApi()
    api.create_repo(repo_id, repo_type="space", space_sdk="gradio", exist_ok=True)
    # Lists, copied: upload_folder extends ignore_patterns in place.
    commit = api.upload_folder(
        repo_id=repo_id,
        repo_type="space",
        folder_path=folder,
        commit_message=message,
        ignore_patterns=list(IGNORE_PATTERNS),
        delete_patterns=list(IGNORE_PATTERNS),
    )
    return commit.commit_url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo_id", "--repo-id", required=True, help="the Space, as USER/NAME")
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="print the files that would be uploaded, and upload nothing",
    )
    parser.add_argument("--message", default="Deploy persona-chat", help="commit message")
    args = parser.parse_args(argv)
    if args.repo_id.count("/") != 1 or not all(args.repo_id.split("/")):
        parser.error(f"--repo_id must be USER/NAME, got {args.repo_id!r}")
    if args.dry_run:
        print("\n".join(files_to_upload()))
        return 0
    print(f"uploaded: {deploy(args.repo_id, message=args.message)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
