# vmmd in a container. Build: docker build -t vmmd .
# Run (host backend):  docker run --rm -v /run/vmmd:/run/vmmd vmmd
# Run (GPU): add --gpus all
# Clients in other containers mount the same /run/vmmd and set VMMD_SOCKET_DIR=/run/vmmd.

FROM node:20-bookworm AS build
WORKDIR /app
# The whole tree (.dockerignore keeps node_modules, build output and .git out).
COPY . .
# npm ci builds the addon (node-gyp, no CUDA toolkit needed: libcuda is opened at run time)
# and the TypeScript (prepare); then only production dependencies stay.
RUN npm ci && npm prune --omit=dev

FROM node:20-bookworm-slim
ENV NODE_ENV=production NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /app
COPY --from=build /app/package.json ./
COPY --from=build /app/node_modules node_modules
COPY --from=build /app/build/Release/vmmd_native.node build/Release/vmmd_native.node
COPY --from=build /app/dist dist
COPY --from=build /app/proto proto
COPY --from=build /app/bin bin
VOLUME /run/vmmd
HEALTHCHECK --interval=30s --timeout=5s CMD ["node", "bin/vmmctl.js", "--socket-dir", "/run/vmmd", "version"]
ENTRYPOINT ["node", "bin/vmmd.js", "--socket-dir", "/run/vmmd"]
