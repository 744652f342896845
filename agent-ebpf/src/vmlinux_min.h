/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * The few kernel types hopscope.bpf.c reads, declared by hand for CO-RE.
 *
 * Every struct carries preserve_access_index, so clang records each field access
 * as a BTF relocation and libbpf/aya patch the offsets to the running kernel's
 * layout at load time (checked against /sys/kernel/btf/vmlinux). Only the fields
 * we read are listed; their order and the absence of the other fields do not
 * matter. This replaces a 3 MB generated vmlinux.h.
 */
#ifndef HOPSCOPE_VMLINUX_MIN_H
#define HOPSCOPE_VMLINUX_MIN_H

#include <linux/types.h>

#pragma clang attribute push(__attribute__((preserve_access_index)), apply_to = record)

struct inode {
	__u16 i_mode; /* umode_t */
	unsigned long i_ino;
};

struct file {
	struct inode *f_inode;
	void *private_data; /* struct socket * for sockets */
};

struct fdtable {
	unsigned int max_fds;
	struct file **fd;
};

struct files_struct {
	struct fdtable *fdt;
};

struct ns_common {
	unsigned int inum;
};

struct pid_namespace {
	struct ns_common ns;
};

/* A task's pid in one namespace. */
struct upid {
	int nr;
	struct pid_namespace *ns;
};

struct pid {
	unsigned int level;
	/* level + 1 entries, the initial namespace first. Flexible, as in the
	 * kernel: CO-RE and the verifier then allow any constant index. */
	struct upid numbers[];
};

struct task_struct {
	unsigned int __state; /* Linux 5.14+ (README: 5.15) */
	int pid;
	int tgid;
	int exit_code;
	char comm[16];
	struct files_struct *files;
	struct task_struct *group_leader;
	struct pid *thread_pid;
};

struct in6_addr {
	__u8 s6_addr[16]; /* a union in the kernel; only the bytes matter */
};

struct sock_common {
	__be32 skc_daddr;
	__be32 skc_rcv_saddr;
	__be16 skc_dport;
	__u16 skc_num;
	unsigned short skc_family;
	struct in6_addr skc_v6_daddr;
	struct in6_addr skc_v6_rcv_saddr;
};

struct sock {
	struct sock_common __sk_common;
};

struct socket {
	struct sock *sk;
};

struct sk_buff {
	struct sock *sk; /* in an anonymous union; CO-RE finds it there */
};

#pragma clang attribute pop

#endif /* HOPSCOPE_VMLINUX_MIN_H */
