#!/usr/bin/env python3
"""Make a local certificate authority and one TLS key + certificate per dpsketch service.

    python deploy/make-certs.py OUTDIR --hosts s1,s2,s3,analyzer,localhost,127.0.0.1

writes into OUTDIR:
  ca.pem, ca-key.pem          the CA (give ca.pem to clients, the analyzer and the SDK;
                              keep ca-key.pem offline or delete it)
  NAME.pem, NAME-key.pem      for each DNS name in --hosts: a server certificate whose
                              subjectAltName lists NAME plus every --shared-san
                              (default: localhost, 127.0.0.1, ::1), so a service is reachable
                              by its compose service name and on loopback

IP addresses in --hosts get no certificate of their own; they are added to every certificate's
SANs. Private keys are written with mode 0600 (owner only). --key-group GROUP instead gives the
service keys (not the CA key) that group and mode 0640, so a service running as another user
that is in GROUP can read its key while other users on the host cannot: the compose file
(docker-compose.yml, TLS by default) runs each container with that group added (DPSKETCH_CERTS_GID).
An existing CA in OUTDIR is reused (so new services can be added later) unless --new-ca is
given; existing service files are overwritten.
Only for a local or private deployment: a public one should use certificates from its own CA.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, private: bool, group: int | None = None) -> None:
    mode = (0o640 if group is not None else 0o600) if private else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else mode)
    with os.fdopen(fd, "wb") as f:
        if group is not None:
            os.fchown(f.fileno(), -1, group)  # the group first, then open it up to the group
        os.fchmod(f.fileno(), mode)  # O_CREAT's mode does not apply to an existing file
        f.write(data)


def _group(value: str) -> int:
    """A group name or numeric gid (the gid need not exist on this host)."""
    if value.isdigit():
        return int(value)
    import grp

    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise argparse.ArgumentTypeError(f"no group named {value!r}") from None


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def make_ca(common_name: str, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, name: str,
              sans: list[str], days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_san(s) for s in sans]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False,
                                     content_commitment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _split(value: str) -> list[str]:
    return [h for h in (x.strip() for x in value.split(",")) if h]


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make-certs.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", type=Path, help="directory to write into (created if missing)")
    p.add_argument("--hosts", required=True, type=_split, metavar="NAME,NAME,...",
                   help="service DNS names (one certificate each) and IP addresses (SANs of all)")
    p.add_argument("--shared-san", default="localhost,127.0.0.1,::1", type=_split, metavar="NAME,...",
                   help="names/IPs added to every certificate (default: %(default)s)")
    p.add_argument("--days", type=int, default=825, help="validity of the service certificates")
    p.add_argument("--ca-days", type=int, default=3650, help="validity of a new CA")
    p.add_argument("--ca-name", default="dpsketch local CA", help="common name of a new CA")
    p.add_argument("--new-ca", action="store_true", help="replace an existing CA in OUTDIR")
    p.add_argument("--key-group", type=_group, metavar="GROUP",
                   help="give the service keys this group (name or gid) and mode 0640 instead of "
                        "0600, for services running as another user in that group (the CA key "
                        "stays 0600); changing to a group you are not in needs root")
    args = p.parse_args(argv)

    out: Path = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    ips = [h for h in args.hosts if _is_ip(h)]
    names = [h for h in args.hosts if not _is_ip(h)]
    if not names:
        p.error("--hosts names no service (only IP addresses)")

    ca_pem, ca_key_pem = out / "ca.pem", out / "ca-key.pem"
    if ca_pem.exists() and ca_key_pem.exists() and not args.new_ca:
        ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_pem.read_bytes(), password=None)
        print(f"reusing the CA in {ca_pem}")
    else:
        ca_key, ca_cert = make_ca(args.ca_name, args.ca_days)
        _write(ca_key_pem, _key_pem(ca_key), private=True)
        _write(ca_pem, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
        print(f"wrote {ca_pem} and {ca_key_pem}")

    for name in names:
        sans = list(dict.fromkeys([name, *ips, *args.shared_san]))
        key, cert = make_leaf(ca_key, ca_cert, name, sans, args.days)
        try:
            _write(out / f"{name}-key.pem", _key_pem(key), private=True, group=args.key_group)
        except PermissionError as exc:
            p.error(f"cannot give {name}-key.pem the group {args.key_group}: {exc} "
                    f"(use a group you are in, e.g. $(id -g), or run as root)")
        _write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
        print(f"wrote {out / (name + '.pem')} and {name}-key.pem  (SANs: {', '.join(sans)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
