#!/bin/sh
# Installs what the cluster tests start on this machine: a SLURM controller and node daemons,
# munge, an ssh server and client, pdsh (Debian/Ubuntu package names). Idempotent: a program
# already there is not installed again. Without root or apt-get it says what it skipped and
# exits 0 (the tests then skip, or fail when LONGSPEC_REQUIRE_CLUSTER=1); a failed install exits
# non-zero only when LONGSPEC_REQUIRE_CLUSTER=1.
set -u
need=""
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
have slurmctld || need="$need slurmctld"
have slurmd    || need="$need slurmd"
have sbatch    || need="$need slurm-client"
have munged    || need="$need munge"
have sshd      || need="$need openssh-server"
have ssh       || need="$need openssh-client"
have ssh-keygen || need="$need openssh-client"
have pdsh      || need="$need pdsh"
need=$(echo $need | tr ' ' '\n' | sort -u | tr '\n' ' ' | sed 's/ *$//')
if [ -z "$need" ]; then
    echo "cluster tests: slurm, munge, ssh and pdsh are installed"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "cluster tests: not installing $need (needs root and apt-get); the cluster tests will skip"
    exit 0
fi
echo "cluster tests: installing $need"
export DEBIAN_FRONTEND=noninteractive
# Package scripts must not start the system's own daemons: the tests start theirs.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
rc=0
if ! apt-get install -y -q -o Dpkg::Use-Pty=0 --no-install-recommends $need >/tmp/longspec-cluster-install.log 2>&1; then
    apt-get update -q >>/tmp/longspec-cluster-install.log 2>&1
    apt-get install -y -q -o Dpkg::Use-Pty=0 --no-install-recommends $need >>/tmp/longspec-cluster-install.log 2>&1 || rc=$?
fi
[ "$made_policy" = 1 ] && rm -f "$policy"
if [ "$rc" != 0 ]; then
    echo "cluster tests: apt-get install failed (exit $rc); last lines of /tmp/longspec-cluster-install.log:"
    tail -n 20 /tmp/longspec-cluster-install.log
    # CI requires the cluster tests: fail here, with the reason; elsewhere they skip.
    [ "${LONGSPEC_REQUIRE_CLUSTER:-0}" != 0 ] && exit "$rc"
    exit 0
fi
echo "cluster tests: installed $need"
