# The driver of a Python session (async-grpo-process's `Interpreter`): one interpreter that
# runs cell after cell in one namespace, as a notebook does.
#
# Protocol, on the pipes the engine holds (the cells' own stdin, stdout and stderr are
# /dev/null between cells and one unnamed file during a cell):
#   the driver says  b"ready\n"                               once started
#   the engine sends b"<code bytes> <output limit>\n" + code  one cell
#   the driver says  b"<ok|error> <kept> <total>\n" + output  the cell's output: stdout and
#                    stderr as written, interleaved; its first <kept> bytes of <total>
# The engine trusts none of it: a cell can write anything on these pipes, and the engine
# ends the session when what it reads breaks the protocol.
import ast
import os
import sys
import traceback


def read_exactly(pipe, size):
    data = bytearray()
    while len(data) < size:
        chunk = pipe.read(size - len(data))
        if not chunk:
            return None
        data.extend(chunk)
    return bytes(data)


def run(source, namespace):
    tree = ast.parse(source, "<cell>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), namespace)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), namespace)
        if value is not None:
            print(repr(value))


def show(error):
    # The cell's frames only: the driver's own are no business of the model's.
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb)


def output_file():
    try:
        return os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:
        import tempfile

        return os.dup(tempfile.TemporaryFile().fileno())


def main():
    requests = os.fdopen(os.dup(0), "rb", buffering=0)
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    replies.write(b"ready\n")
    while True:
        header = requests.readline(64)
        if not header:
            return
        size, limit = (int(field) for field in header.split())
        code = read_exactly(requests, size)
        if code is None:
            return
        out = output_file()
        os.dup2(out, 1)
        os.dup2(out, 2)
        status = b"ok"
        try:
            run(code.decode("utf-8", "replace"), namespace)
        except BaseException as error:
            status = b"error"
            show(error)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
        os.dup2(null, 1)
        os.dup2(null, 2)
        total = os.fstat(out).st_size
        os.lseek(out, 0, os.SEEK_SET)
        kept = bytearray()
        while len(kept) < min(limit, total):
            chunk = os.read(out, min(limit, total) - len(kept))
            if not chunk:
                break
            kept.extend(chunk)
        os.close(out)
        replies.write(b"%s %d %d\n" % (status, len(kept), total) + bytes(kept))


main()
