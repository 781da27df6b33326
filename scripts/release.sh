#!/usr/bin/env bash
# Tag a release of dpsketch: check that the commit is that version and the change log says so,
# then make the annotated tag v<VERSION> on it (docs/install.md, "Versions and releases").
#
#   scripts/release.sh VERSION           # e.g. 0.2.0: the checks, then `git tag -a vVERSION`
#   scripts/release.sh --check VERSION   # the checks only; tags nothing
#
# The checks, each a one-line refusal (exit status 1) naming what to fix:
#   1. VERSION is a release number: MAJOR.MINOR.PATCH, optionally a pre-release aN, bN or rcN
#      (PEP 440); never a .devN (what the tree says between releases) or a local +label;
#   2. dpsketch/__init__.py's __version__ is VERSION (the one version: the wheel, `dpsketch
#      --version` and the servers' /v1/info read it);
#   3. CHANGELOG.md has the heading `## VERSION (YYYY-MM-DD)`: dated, not "(unreleased)";
#   4. the work tree is clean, so the tag names exactly what was checked (HEAD);
#   5. no tag vVERSION exists yet.
# The tag's message is "dpsketch VERSION" and the change log's section for it. Nothing is pushed.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "release: $*" >&2; exit 1; }

check_only=0
if [[ "${1:-}" == "--check" ]]; then check_only=1; shift; fi
[[ $# -eq 1 ]] || { sed -n '5,6p' "$0" | sed 's/^# \{0,1\}/usage: /' >&2; exit 2; }
version="$1"

[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+((a|b|rc)[0-9]+)?$ ]] \
    || die "$version is not a release number (MAJOR.MINOR.PATCH, optionally aN, bN or rcN; no .devN, no +label)"

source_version="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' dpsketch/__init__.py)"
[[ "$source_version" == "$version" ]] \
    || die "dpsketch/__init__.py says __version__ = \"$source_version\", not \"$version\": set it and commit"

escaped="${version//./\\.}"
heading="$(grep -E "^## $escaped( |$)" CHANGELOG.md || true)"
[[ -n "$heading" ]] || die "CHANGELOG.md has no section \"## $version (YYYY-MM-DD)\""
[[ "$heading" =~ ^"## $version ("[0-9]{4}-[0-9]{2}-[0-9]{2}")"$ ]] \
    || die "CHANGELOG.md's heading \"$heading\" is not dated: make it \"## $version ($(date -u +%F))\" and commit"

[[ -z "$(git status --porcelain)" ]] || die "the work tree has uncommitted changes: commit or stash them first"
! git rev-parse -q --verify "refs/tags/v$version" >/dev/null || die "tag v$version exists already"

# the section: from its heading to the next release's heading
notes="$(awk -v h="$heading" '$0 == h {on = 1; next} on && /^## / {exit} on {print}' CHANGELOG.md)"
if [[ $check_only == 1 ]]; then
    echo "release: $version ready to tag at $(git rev-parse --short HEAD)"
    exit 0
fi
printf 'dpsketch %s\n\n%s\n' "$version" "$notes" | git tag -a "v$version" -F - --cleanup=whitespace
echo "release: tagged v$version at $(git rev-parse --short HEAD); push it with: git push origin v$version" >&2
echo "release: then set __version__ to the next number with .dev0 and add its \"(unreleased)\" section" >&2
