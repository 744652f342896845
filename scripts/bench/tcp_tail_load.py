# The load of scripts/bench/tcp_tail_cost.sh: 3000 TCP sends and reads of SIZE bytes on loopback.
import socket, time, sys
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
c = socket.create_connection(srv.getsockname()); s, _ = srv.accept()
for x in (c, s):
    x.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20); x.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
n = int(sys.argv[1])
data = b"x" * n
time.sleep(1.0)
for i in range(3000):
    c.send(data)
    s.recv(n, socket.MSG_WAITALL)
