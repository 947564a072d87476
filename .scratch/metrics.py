import ast, io, sys, tokenize, pathlib
root = pathlib.Path(sys.argv[1])
tot = nb = code = 0
long_funcs = []; long_classes = []
for p in sorted(root.rglob('*.py')):
    src = p.read_text(); lines = src.splitlines()
    tot += len(lines); nb += sum(1 for l in lines if l.strip())
    tree = ast.parse(src)
    doc_lines = set()
    for node in ast.walk(tree):
        if isinstance(node,(ast.Module,ast.FunctionDef,ast.AsyncFunctionDef,ast.ClassDef)):
            if node.body and isinstance(node.body[0],ast.Expr) and isinstance(getattr(node.body[0],'value',None),ast.Constant) and isinstance(node.body[0].value.value,str):
                doc_lines.update(range(node.body[0].lineno, node.body[0].end_lineno+1))
        if isinstance(node,(ast.FunctionDef,ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > 60: long_funcs.append((n, f"{p}:{node.lineno} {node.name}"))
        if isinstance(node, ast.ClassDef):
            n = node.end_lineno - node.lineno + 1
            if n > 250: long_classes.append((n, f"{p}:{node.lineno} {node.name}"))
    for i,l in enumerate(lines,1):
        s=l.strip()
        if s and not s.startswith('#') and i not in doc_lines: code+=1
print(f"total {tot} nonblank {nb} code(no blank/comment/docstring) {code}")
for n,s in sorted(long_funcs, reverse=True): print("FUNC", n, s)
for n,s in sorted(long_classes, reverse=True): print("CLASS", n, s)
